//! A real decode worker started in this process for a measurement (`duet bench transfer`): it
//! serves on a loopback port with the engine settings given, and is ready once it answers
//! `Stats`.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use duet_engine::engine::EngineOptions;
use duet_proto::v1;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A worker serving in this process.
pub(crate) struct Worker {
    pub(crate) url: String,
    pub(crate) fingerprint: String,
}

/// A loopback listener on a free port.
pub(crate) async fn listen() -> Result<TcpListener> {
    Ok(TcpListener::bind("127.0.0.1:0").await?)
}

fn worker_args(model: &Path, engine: EngineOptions) -> duet_worker::WorkerArgs {
    duet_worker::WorkerArgs {
        engine,
        ..duet_worker::WorkerArgs::for_model(model.to_path_buf())
    }
}

/// A decode worker serving `model` on `listener`, accepting plans that name the prefill
/// workers at `prefill`.
pub(crate) async fn decode_worker(
    listener: TcpListener,
    model: &Path,
    engine: EngineOptions,
    prefill: Vec<String>,
) -> Result<Worker> {
    let config = duet_decode_worker::DecodeConfig {
        listen: listener.local_addr()?,
        prefill,
        worker: worker_args(model, engine),
        ..Default::default()
    };
    let address = config.listen.to_string();
    let server = tokio::spawn(duet_decode_worker::serve(
        config,
        listener,
        std::future::pending(),
    ));
    answering("decode", address, server).await
}

/// Waits until the worker `server` runs at `address` answers, or fails as it starts.
async fn answering(kind: &str, address: String, server: JoinHandle<Result<()>>) -> Result<Worker> {
    let url = format!("http://{address}");
    loop {
        if server.is_finished() {
            return Err(match server.await {
                Ok(Err(e)) => e.context(format!("the in-process {kind} worker did not start")),
                _ => anyhow::anyhow!("the in-process {kind} worker stopped as it started"),
            });
        }
        if let Ok(mut c) =
            v1::worker_control_client::WorkerControlClient::connect(url.clone()).await
            && let Ok(s) = c.stats(v1::StatsRequest {}).await
        {
            let s = s.into_inner();
            return Ok(Worker {
                url,
                fingerprint: s.model_fingerprint,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
