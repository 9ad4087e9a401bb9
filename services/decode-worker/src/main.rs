//! `duet-decode`: one decode worker, until SIGTERM or ctrl-c, then drains.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "duet-decode",
    version,
    about = "duet decode worker: KV reservations, continuous batching, token streaming"
)]
struct Cli {
    #[command(flatten)]
    config: duet_decode_worker::DecodeConfig,
    #[command(flatten)]
    telemetry: duet_telemetry::TelemetryArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Kept to the end: dropping it sends the last spans.
    let _exporter = cli.telemetry.init("duet-decode", std::io::stdout)?;
    let listener = tokio::net::TcpListener::bind(cli.config.listen).await?;
    duet_decode_worker::serve(cli.config, listener, duet_proto::serve::terminated()).await
}
