//! API keys of the public API (`--api-keys-file`): every `Generation` call carries
//! `authorization: Bearer KEY` metadata, every OpenAI HTTP call (all but `/health` and `/live`)
//! the same header,
//! or is refused (UNAUTHENTICATED / HTTP 401) before it is read any further. Health, liveness
//! and reflection stay open. Keys are compared in constant time, against every key. The gRPC
//! check is here ([`RequireApiKey`]); the HTTP front's middleware calls [`ApiKeys::check`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::{Either, Ready, ready};
use tonic::codegen::Service;
use tonic::codegen::http::{Request as HttpRequest, Response as HttpResponse};
use tonic::server::NamedService;

use crate::error::{RouterError, Unauthenticated};

/// The header (gRPC metadata key) carrying the key.
pub const AUTHORIZATION: &str = "authorization";

/// A keys file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ApiKeysError {
    #[error("reading the API keys file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the API keys file {0} holds no key (one key a line; `#` starts a comment)")]
    Empty(PathBuf),
}

/// The keys that may call the public API (never printed).
pub struct ApiKeys(Vec<Box<str>>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.0.len())
    }
}

impl ApiKeys {
    /// Reads a keys file: one key a line, surrounding whitespace ignored; empty lines and lines
    /// starting with `#` are skipped.
    pub fn load(path: &Path) -> Result<Self, ApiKeysError> {
        let text = std::fs::read_to_string(path).map_err(|source| ApiKeysError::Read {
            path: path.to_owned(),
            source,
        })?;
        let keys = Self::parse(&text);
        if keys.0.is_empty() {
            return Err(ApiKeysError::Empty(path.to_owned()));
        }
        Ok(keys)
    }

    /// The first key of the file (what a launcher's own readiness probe of the router uses).
    pub fn first(&self) -> &str {
        &self.0[0]
    }

    fn parse(text: &str) -> Self {
        Self(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(Into::into)
                .collect(),
        )
    }

    /// Checks an `authorization` value (`Bearer KEY`, the scheme in any case). Every key is
    /// compared, each in constant time, so the time taken says nothing about which matched.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), Unauthenticated> {
        let presented = authorization
            .and_then(|v| {
                let (scheme, key) = v.split_at_checked(7)?;
                scheme.eq_ignore_ascii_case(b"bearer ").then_some(key)
            })
            .ok_or(Unauthenticated)?;
        let found = self.0.iter().fold(false, |found, key| {
            found | duet_proto::auth::constant_time_eq(key.as_bytes(), presented)
        });
        found.then_some(()).ok_or(Unauthenticated)
    }
}

/// The gRPC check around the `Generation` service, before its message is decoded (health and
/// reflection are services of their own, so they stay open). Without keys, every call passes.
#[derive(Clone, Debug)]
pub struct RequireApiKey<S> {
    pub inner: S,
    pub keys: Option<Arc<ApiKeys>>,
}

impl<S: NamedService> NamedService for RequireApiKey<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<HttpRequest<B>> for RequireApiKey<S>
where
    S: Service<HttpRequest<B>, Response = HttpResponse<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: HttpRequest<B>) -> Self::Future {
        let checked = self.keys.as_ref().map_or(Ok(()), |keys| {
            keys.check(request.headers().get(AUTHORIZATION).map(|v| v.as_bytes()))
        });
        match checked {
            Ok(()) => Either::Left(self.inner.call(request)),
            Err(e) => Either::Right(ready(Ok(
                tonic::Status::from(RouterError::from(e)).into_http()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_file_lines_and_bearer_values() {
        let keys = ApiKeys::parse("# ops team\n  key-one  \n\nkey-two\n#key-three\n");
        assert_eq!(keys.0.len(), 2);
        assert!(keys.check(Some(b"Bearer key-one")).is_ok());
        assert!(keys.check(Some(b"bearer key-two")).is_ok());
        for refused in [
            None,
            Some(&b"Bearer key-three"[..]),
            Some(b"Bearer #key-three"),
            Some(b"Bearer key-on"),
            Some(b"Bearer key-one2"),
            Some(b"key-one"),
            Some(b"Basic key-one"),
            Some(b"Bearer "),
            Some(b""),
        ] {
            assert!(keys.check(refused).is_err(), "{refused:?}");
        }
        let path = std::env::temp_dir().join(format!("duet-api-keys-{}", std::process::id()));
        std::fs::write(&path, "# nothing yet\n\n").unwrap();
        let e = ApiKeys::load(&path).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(e.to_string().contains("holds no key"), "{e}");
    }
}
