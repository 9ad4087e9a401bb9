//! `duet health`: one gRPC health check (`grpc.health.v1.Health/Check`) of a duet service, for
//! the places that cannot make one themselves: a Kubernetes `exec` probe of a worker whose port
//! requires a client certificate (the kubelet's own gRPC probe presents none), or a script.
//! Exits 0 when the service answers SERVING, 1 with the reason otherwise.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

#[derive(Args, Debug)]
pub struct HealthArgs {
    /// The service's gRPC address (host:port).
    #[arg(long, env = "DUET_HEALTH_SERVER", default_value = "127.0.0.1:50051")]
    pub server: String,
    /// The service asked about: "" (the whole server, the default) or a service name such as
    /// duet.v1.DecodeWorker.
    #[arg(long, default_value = "")]
    pub service: String,
    /// Answer within this many milliseconds, or the check fails.
    #[arg(long, env = "DUET_HEALTH_TIMEOUT_MS", default_value_t = 2000)]
    pub timeout_ms: u64,
    /// CA certificate (PEM) the server's certificate is checked against; dial over TLS.
    #[arg(long, env = "DUET_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) to present: a worker's port requires one. With --tls-key.
    #[arg(long, env = "DUET_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "DUET_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The name the server's certificate must carry, when it is not the host of --server (a
    /// probe dials 127.0.0.1, the certificate names the Service).
    #[arg(long, env = "DUET_HEALTH_TLS_SERVER_NAME", requires = "tls_ca")]
    pub tls_server_name: Option<String>,
}

pub fn run(args: HealthArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(check(&args))
}

async fn check(args: &HealthArgs) -> Result<()> {
    let tls = match (&args.tls_ca, &args.tls_cert, &args.tls_key) {
        (None, _, _) => None,
        (Some(ca), Some(cert), Some(key)) => {
            let tls = duet_proto::TlsArgs::new(cert.clone(), key.clone(), ca.clone())
                .load()?
                .context("TLS material")?;
            Some(tls.client())
        }
        (Some(ca), _, _) => Some(duet_proto::tls::client_trusting(ca)?),
    };
    let tls = match (tls, &args.tls_server_name) {
        (Some(tls), Some(name)) => Some(tls.domain_name(name.clone())),
        (tls, _) => tls,
    };
    let timeout = Duration::from_millis(args.timeout_ms.max(1));
    let status = tokio::time::timeout(timeout, async {
        let channel = duet_proto::channels::endpoint(&args.server, tls.as_ref())?
            .connect_timeout(timeout)
            .connect()
            .await
            .with_context(|| format!("connecting to {}", args.server))?;
        let mut request = tonic::Request::new(HealthCheckRequest {
            service: args.service.clone(),
        });
        request.set_timeout(timeout);
        let status = HealthClient::new(channel)
            .check(request)
            .await
            .with_context(|| format!("health check of {}", args.server))?
            .into_inner()
            .status();
        anyhow::Ok(status)
    })
    .await
    .with_context(|| format!("{} did not answer within {timeout:?}", args.server))??;
    match status {
        ServingStatus::Serving => {
            println!("SERVING");
            Ok(())
        }
        other => bail!("{} is {}", args.server, other.as_str_name()),
    }
}
