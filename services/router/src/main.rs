//! `duet-router`: serves the public Generation API in front of the prefill and decode pools.

use clap::Parser;
use duet_router::RouterConfig;

#[derive(Parser, Debug)]
#[command(
    name = "duet-router",
    version,
    about = "duet router: public Generation API, routing, failover"
)]
struct Cli {
    #[command(flatten)]
    config: RouterConfig,
    #[command(flatten)]
    telemetry: duet_telemetry::TelemetryArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Only `duet up` shares an embedded registry with its workers: a router on its own learns of
    // them from the flags or from etcd, or never serves a request.
    anyhow::ensure!(
        !cli.config.decode.is_empty() || !cli.config.cluster.etcd.is_empty(),
        "duet-router needs its decode workers: --decode ADDR (DUET_DECODE_WORKERS) or --etcd URL \
         where the workers register"
    );
    // Kept to the end: dropping it sends the last spans.
    let _exporter = cli.telemetry.init("duet-router", std::io::stdout)?;
    let listener = tokio::net::TcpListener::bind(cli.config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cli.config.listen))?;
    duet_router::serve(cli.config, listener, duet_proto::serve::terminated()).await
}
