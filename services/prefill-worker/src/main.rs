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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let config = Cli::parse().config;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    duet_prefill_worker::serve(config, listener, duet_worker::membership::terminated()).await
}
