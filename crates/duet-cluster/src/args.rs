//! The membership flags: which registry and cluster every service uses, and the workers' lease.

use std::ffi::OsString;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use crate::backoff::Backoff;
use crate::card::validate_name;
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
}

impl Default for ClusterArgs {
    fn default() -> Self {
        Self {
            etcd: Vec::new(),
            cluster: "default".into(),
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
        args
    }

    /// The registry: etcd when endpoints are given (it must answer), else this process's
    /// embedded one.
    pub async fn connect(&self) -> Result<Arc<dyn Registry>, ClusterError> {
        validate_name("cluster", &self.cluster)?;
        if self.etcd.is_empty() {
            Ok(EmbeddedRegistry::shared())
        } else {
            Ok(Arc::new(EtcdRegistry::connect(&self.etcd).await?))
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
