//! `duet-prefill`: runs one prefill worker until SIGTERM or ctrl-c, then drains (see the `duet_prefill_worker` library).

use anyhow::Context;
use clap::Parser;
use duet_prefill_worker::PrefillConfig;

/// duet prefill worker: batched prefill with a prefix cache; pushes KV to decode workers.
#[derive(Parser)]
#[command(name = "duet-prefill", version)]
struct Cli {
    #[command(flatten)]
    config: PrefillConfig,
    #[command(flatten)]
    telemetry: duet_telemetry::TelemetryArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Cli { config, telemetry } = Cli::parse();
    // Kept to the end: dropping it sends the last spans.
    let _exporter = telemetry.init("duet-prefill", std::io::stdout)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    duet_prefill_worker::serve(config, listener, duet_proto::serve::terminated()).await
}
