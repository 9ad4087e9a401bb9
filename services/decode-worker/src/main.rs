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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let cli = Cli::parse();
    let listener = tokio::net::TcpListener::bind(cli.config.listen).await?;
    duet_decode_worker::serve(cli.config, listener, duet_worker::membership::terminated()).await
}
