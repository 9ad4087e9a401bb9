//! The cluster token: a shared secret every internal call carries (metadata
//! [`CLUSTER_TOKEN_HEADER`]), attached to outgoing calls by [`crate::channels::PeerMetadata`] and checked on
//! arrival by [`ClusterAuthLayer`] in every service's edge. Internal RPCs (`Decode`, `Prefill`,
//! `KvTransfer`, `WorkerControl`, `WorkerAdmin`) without it are refused with UNAUTHENTICATED before any handler
//! runs, so such a caller learns nothing about the model; the public `Generation` API, health
//! and reflection stay open.

use std::ffi::OsString;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::{Either, Ready, ready};
use http::{Request, Response};
use tonic::body::Body;
use tower::{Layer, Service};

/// The gRPC metadata key carrying the cluster token.
pub const CLUSTER_TOKEN_HEADER: &str = "duet-cluster-token";

/// The environment variable a launcher hands the token to a child process in (never its command
/// line, which other users of the machine can read).
pub const CLUSTER_TOKEN_ENV: &str = "DUET_CLUSTER_TOKEN";

/// A cluster token that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("the cluster token must be 16 to 256 visible ASCII characters")]
    BadToken,
    #[error("reading the cluster token file {path}: {source}")]
    TokenFile {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The cluster's shared secret (never printed).
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterToken(Arc<str>);

impl ClusterToken {
    /// A fresh token: 128 bits from the operating system's random source, in hex.
    pub fn random() -> Self {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).expect("the operating system's random source failed");
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Self(hex.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn matches(&self, presented: &[u8]) -> bool {
        constant_time_eq(self.0.as_bytes(), presented)
    }
}

/// Whether a presented secret equals the expected one, compared without an early exit, so the
/// time taken says nothing about how much matched (only whether the lengths differ).
pub fn constant_time_eq(expected: &[u8], presented: &[u8]) -> bool {
    expected.len() == presented.len()
        && expected
            .iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

impl FromStr for ClusterToken {
    type Err = AuthError;

    fn from_str(s: &str) -> Result<Self, AuthError> {
        let ok = (16..=256).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic());
        if !ok {
            return Err(AuthError::BadToken);
        }
        Ok(Self(s.into()))
    }
}

impl std::fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterToken(..)")
    }
}

/// The cluster token flags every service takes.
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct ClusterAuth {
    /// Shared secret of the cluster's internal calls (16-256 visible ASCII characters); Decode,
    /// Prefill, KvTransfer and WorkerControl refuse calls without it (UNAUTHENTICATED). Unset:
    /// they are open to anyone who reaches the port.
    #[arg(long, env = CLUSTER_TOKEN_ENV, hide_env_values = true)]
    pub cluster_token: Option<ClusterToken>,
    /// File holding the cluster token (surrounding whitespace ignored), instead of
    /// --cluster-token.
    #[arg(
        long,
        env = "DUET_CLUSTER_TOKEN_FILE",
        conflicts_with = "cluster_token"
    )]
    pub cluster_token_file: Option<PathBuf>,
}

impl ClusterAuth {
    /// Authenticates with `token`.
    pub fn with_token(token: ClusterToken) -> Self {
        Self {
            cluster_token: Some(token),
            cluster_token_file: None,
        }
    }

    /// The token, read from its file when given one; `None`: internal calls are open.
    pub fn token(&self) -> Result<Option<ClusterToken>, AuthError> {
        match &self.cluster_token_file {
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|source| AuthError::TokenFile {
                        path: path.clone(),
                        source,
                    })?;
                text.trim().parse().map(Some)
            }
            None => Ok(self.cluster_token.clone()),
        }
    }

    /// The flags as a command line: the file only. The token itself goes to a child process in
    /// its environment ([`ClusterAuth::to_env`]).
    pub fn to_args(&self) -> Vec<OsString> {
        self.cluster_token_file
            .iter()
            .map(|p| {
                let mut arg = OsString::from("--cluster-token-file=");
                arg.push(p);
                arg
            })
            .collect()
    }

    /// The token as a child process's environment variable.
    pub fn to_env(&self) -> Option<(&'static str, &str)> {
        self.cluster_token
            .as_ref()
            .map(|t| (CLUSTER_TOKEN_ENV, t.as_str()))
    }
}

/// Whether anyone may call a path: health, reflection and the public API.
pub(crate) fn is_open(path: &str) -> bool {
    crate::serve::is_infrastructure(path) || path.starts_with("/duet.v1.Generation/")
}

/// Refuses calls to internal RPCs that lack the cluster token; with no token configured,
/// passes everything.
#[derive(Clone, Debug)]
pub struct ClusterAuthLayer {
    token: Option<ClusterToken>,
}

impl ClusterAuthLayer {
    pub fn new(token: Option<ClusterToken>) -> Self {
        Self { token }
    }
}

impl<S> Layer<S> for ClusterAuthLayer {
    type Service = ClusterAuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ClusterAuthService {
            inner,
            token: self.token.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct ClusterAuthService<S> {
    inner: S,
    token: Option<ClusterToken>,
}

impl<S, B> Service<Request<B>> for ClusterAuthService<S>
where
    S: Service<Request<B>, Response = Response<Body>>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<Response<Body>, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let presented = request.headers().get(CLUSTER_TOKEN_HEADER);
        let allowed = match &self.token {
            None => true,
            Some(token) => {
                is_open(request.uri().path())
                    || presented.is_some_and(|v| token.matches(v.as_bytes()))
            }
        };
        if allowed {
            Either::Left(self.inner.call(request))
        } else {
            Either::Right(ready(Ok(tonic::Status::unauthenticated(
                "this is an internal call of the cluster: it needs the cluster token",
            )
            .into_http())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_whole_and_never_printed() {
        let t: ClusterToken = "0123456789abcdef".parse().unwrap();
        assert!(t.matches(b"0123456789abcdef"));
        assert!(!t.matches(b"0123456789abcdeF"));
        assert!(!t.matches(b"0123456789abcdef0"));
        assert!(!t.matches(b""));
        assert!("short".parse::<ClusterToken>().is_err());
        assert!("with a space inside it".parse::<ClusterToken>().is_err());
        assert_eq!(format!("{t:?}"), "ClusterToken(..)");
        let (a, b) = (ClusterToken::random(), ClusterToken::random());
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 32);
    }

    #[test]
    fn only_health_reflection_and_the_public_api_are_open() {
        assert!(is_open("/grpc.health.v1.Health/Check"));
        assert!(is_open(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
        ));
        assert!(is_open("/duet.v1.Generation/Generate"));
        for internal in [
            "/duet.v1.DecodeWorker/Decode",
            "/duet.v1.PrefillWorker/Prefill",
            "/duet.v1.KvTransfer/Push",
            "/duet.v1.WorkerControl/Stats",
            "/duet.v1.WorkerAdmin/SwitchRole",
            "/duet.v1.KvEvents/Subscribe",
            "/duet.v1.Unknown/Call",
        ] {
            assert!(!is_open(internal), "{internal}");
        }
    }

    #[test]
    fn the_token_file_is_read_and_trimmed_and_never_on_the_command_line() {
        let dir = std::env::temp_dir().join(format!("duet-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "  0123456789abcdef0123\n").unwrap();
        let auth = ClusterAuth {
            cluster_token: None,
            cluster_token_file: Some(path.clone()),
        };
        assert_eq!(
            auth.token().unwrap().unwrap().as_str(),
            "0123456789abcdef0123"
        );
        assert_eq!(auth.to_args().len(), 1);
        let auth = ClusterAuth::with_token(ClusterToken::random());
        assert!(auth.to_args().is_empty());
        assert_eq!(auth.to_env().unwrap().0, CLUSTER_TOKEN_ENV);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
