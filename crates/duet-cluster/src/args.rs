//! The membership flags: which registry and cluster every service uses, and the workers' lease.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use crate::backoff::Backoff;
use crate::card::{CardKey, validate_name};
use crate::embedded::EmbeddedRegistry;
use crate::error::ClusterError;
use crate::etcd::EtcdRegistry;
use crate::registry::Registry;

/// Where membership is kept (every service).
#[derive(Args, Clone, Debug, PartialEq)]
pub struct ClusterArgs {
    /// etcd endpoints (host:port or http://host:port), comma-separated or repeated. Without
    /// it, membership is kept in this process (the embedded registry of `duet up`).
    #[arg(
        long = "etcd",
        value_name = "URL",
        env = "DUET_ETCD",
        value_delimiter = ','
    )]
    pub etcd: Vec<String>,
    /// The cluster's name: its workers' cards are kept under `/duet/<cluster>/workers/`.
    #[arg(long, env = "DUET_CLUSTER", default_value_t = ClusterArgs::default().cluster, value_parser = parse_cluster)]
    pub cluster: String,
    #[command(flatten)]
    pub etcd_auth: EtcdAuthArgs,
    /// The key worker cards are signed and checked with: the cluster token's, set by the
    /// service that has one ([`ClusterArgs::signed_with`]); not a flag of its own.
    #[arg(skip)]
    pub card_key: Option<CardKey>,
}

/// How duet reaches a secured etcd: TLS (the CA, and a client certificate for etcd's
/// `--client-cert-auth`) and etcd's own authentication (a user and its password).
#[derive(Args, Clone, Debug, Default, PartialEq)]
pub struct EtcdAuthArgs {
    /// CA certificate (PEM) etcd's server certificate is checked against; with it, endpoints
    /// without a scheme are dialled over https (http:// ones are refused).
    #[arg(long, value_name = "PEM", env = "DUET_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) presented to etcd; with --etcd-key, and needs --etcd-ca.
    #[arg(long, value_name = "PEM", env = "DUET_ETCD_CERT", requires_all = ["etcd_key", "etcd_ca"])]
    pub etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(
        long,
        value_name = "PEM",
        env = "DUET_ETCD_KEY",
        requires = "etcd_cert"
    )]
    pub etcd_key: Option<PathBuf>,
    /// etcd user to authenticate as (etcd's `auth enable`); its password comes from
    /// --etcd-password-file, or the environment variable DUET_ETCD_PASSWORD (never argv).
    #[arg(long, value_name = "NAME", env = "DUET_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (surrounding whitespace ignored).
    #[arg(
        long,
        value_name = "PATH",
        env = "DUET_ETCD_PASSWORD_FILE",
        requires = "etcd_user"
    )]
    pub etcd_password_file: Option<PathBuf>,
}

/// The environment variable the etcd user's password may come from instead of a file.
pub const ETCD_PASSWORD_ENV: &str = "DUET_ETCD_PASSWORD";

impl EtcdAuthArgs {
    /// These flags again: parsed back, they give `self` (the password stays in its file or
    /// the environment).
    pub fn to_args(&self) -> Vec<OsString> {
        let path = |flag: &str, p: &Option<PathBuf>| {
            p.as_ref().map(|p| {
                let mut arg = OsString::from(format!("--{flag}="));
                arg.push(p);
                arg
            })
        };
        [
            path("etcd-ca", &self.etcd_ca),
            path("etcd-cert", &self.etcd_cert),
            path("etcd-key", &self.etcd_key),
            self.etcd_user
                .as_ref()
                .map(|u| format!("--etcd-user={u}").into()),
            path("etcd-password-file", &self.etcd_password_file),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// etcd-client's options for these flags: TLS when a CA is given, a user and its password
    /// when a user is. A file that cannot be read, or a user without a password, is an error
    /// naming it.
    pub fn options(&self) -> Result<EtcdSecurity, ClusterError> {
        let read = |what: &str, path: &PathBuf| {
            std::fs::read(path).map_err(|e| {
                ClusterError::EtcdConfig(format!("reading {what} {}: {e}", path.display()))
            })
        };
        let tls = match &self.etcd_ca {
            None => None,
            Some(ca) => {
                let mut tls = etcd_client::TlsOptions::new()
                    .ca_certificate(etcd_client::Certificate::from_pem(read("--etcd-ca", ca)?));
                if let (Some(cert), Some(key)) = (&self.etcd_cert, &self.etcd_key) {
                    tls = tls.identity(etcd_client::Identity::from_pem(
                        read("--etcd-cert", cert)?,
                        read("--etcd-key", key)?,
                    ));
                }
                Some(tls)
            }
        };
        let user = match &self.etcd_user {
            None => None,
            Some(user) => {
                let password = match &self.etcd_password_file {
                    Some(path) => String::from_utf8(read("--etcd-password-file", path)?)
                        .map_err(|_| ClusterError::EtcdConfig(format!("{} is not UTF-8", path.display())))?
                        .trim()
                        .to_string(),
                    None => std::env::var(ETCD_PASSWORD_ENV).map_err(|_| {
                        ClusterError::EtcdConfig(format!(
                            "--etcd-user {user} needs a password: --etcd-password-file PATH, or {ETCD_PASSWORD_ENV}"
                        ))
                    })?,
                };
                Some((user.clone(), password))
            }
        };
        Ok(EtcdSecurity { tls, user })
    }
}

/// What [`EtcdAuthArgs::options`] makes of the flags.
#[derive(Clone, Default)]
pub struct EtcdSecurity {
    pub tls: Option<etcd_client::TlsOptions>,
    /// The user and its password.
    pub user: Option<(String, String)>,
}

impl Default for ClusterArgs {
    fn default() -> Self {
        Self {
            etcd: Vec::new(),
            cluster: "default".into(),
            etcd_auth: EtcdAuthArgs::default(),
            card_key: None,
        }
    }
}

fn parse_cluster(name: &str) -> Result<String, ClusterError> {
    validate_name("cluster", name)?;
    Ok(name.to_string())
}

impl ClusterArgs {
    /// These flags again: parsed back, they give `self`.
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = self
            .etcd
            .iter()
            .map(|e| format!("--etcd={e}").into())
            .collect();
        args.push(format!("--cluster={}", self.cluster).into());
        args.extend(self.etcd_auth.to_args());
        args
    }

    /// These flags, with worker cards signed and checked with `secret` (the cluster token),
    /// when there is one.
    pub fn signed_with(mut self, secret: Option<&[u8]>) -> Self {
        self.card_key = secret.map(CardKey::new);
        self
    }

    /// The registry: etcd when endpoints are given (it must answer), else this process's
    /// embedded one.
    pub async fn connect(&self) -> Result<Arc<dyn Registry>, ClusterError> {
        validate_name("cluster", &self.cluster)?;
        if self.etcd.is_empty() {
            Ok(EmbeddedRegistry::shared())
        } else {
            Ok(Arc::new(
                EtcdRegistry::connect(&self.etcd, self.etcd_auth.options()?).await?,
            ))
        }
    }
}

impl ClusterArgs {
    /// [`ClusterArgs::connect`], retried with backoff (each failure logged with the endpoints)
    /// until it succeeds.
    pub async fn connect_retrying(&self) -> Arc<dyn Registry> {
        let mut backoff = Backoff::new();
        loop {
            match self.connect().await {
                Ok(r) => return r,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot reach the registry; retrying");
                    backoff.wait().await;
                }
            }
        }
    }
}

/// A worker's lease and drain (the worker services).
#[derive(Args, Clone, Debug, PartialEq)]
pub struct LeaseArgs {
    /// Seconds the worker's card outlives the worker's last keep-alive (sent every third of it).
    #[arg(long, env = "DUET_LEASE_TTL_S", default_value_t = LeaseArgs::default().lease_ttl_s, value_parser = clap::value_parser!(u64).range(1..))]
    pub lease_ttl_s: u64,
    /// On SIGTERM: seconds that requests in flight get to finish before the worker exits.
    #[arg(long, env = "DUET_DRAIN_TIMEOUT_S", default_value_t = LeaseArgs::default().drain_timeout_s)]
    pub drain_timeout_s: u64,
}

impl Default for LeaseArgs {
    fn default() -> Self {
        Self {
            lease_ttl_s: 10,
            drain_timeout_s: 30,
        }
    }
}

impl LeaseArgs {
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_s.max(1))
    }

    pub fn drain_timeout(&self) -> Duration {
        Duration::from_secs(self.drain_timeout_s)
    }

    /// These flags again: parsed back, they give `self`.
    pub fn to_args(&self) -> Vec<OsString> {
        vec![
            format!("--lease-ttl-s={}", self.lease_ttl_s).into(),
            format!("--drain-timeout-s={}", self.drain_timeout_s).into(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        cluster: ClusterArgs,
        #[command(flatten)]
        lease: LeaseArgs,
    }

    #[test]
    fn flags_defaults_and_round_trip() {
        let c = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!((c.cluster, c.lease), Default::default());
        let c = Cli::try_parse_from([
            "x",
            "--etcd",
            "a:2379,http://b:2379",
            "--cluster",
            "prod",
            "--lease-ttl-s",
            "3",
            "--drain-timeout-s",
            "0",
        ])
        .unwrap();
        assert_eq!(c.cluster.etcd, ["a:2379", "http://b:2379"]);
        assert_eq!(
            (c.lease.ttl(), c.lease.drain_timeout()),
            (Duration::from_secs(3), Duration::ZERO)
        );
        let argv = ["x".into()]
            .into_iter()
            .chain(c.cluster.to_args())
            .chain(c.lease.to_args());
        let again = Cli::try_parse_from(argv).unwrap();
        assert_eq!((again.cluster, again.lease), (c.cluster, c.lease));
    }

    #[test]
    fn bad_cluster_names_and_ttls_are_refused() {
        let e = Cli::try_parse_from(["x", "--cluster", "a/b"]).unwrap_err();
        assert!(e.to_string().contains("invalid cluster name"), "{e}");
        assert!(Cli::try_parse_from(["x", "--lease-ttl-s", "0"]).is_err());
    }
}
