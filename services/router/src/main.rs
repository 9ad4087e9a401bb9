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
    // Kept to the end: dropping it sends the last spans.
    let _exporter = cli.telemetry.init("duet-router", std::io::stdout)?;
    let listener = tokio::net::TcpListener::bind(cli.config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cli.config.listen))?;
    duet_router::serve(cli.config, listener, duet_proto::serve::terminated()).await
}
