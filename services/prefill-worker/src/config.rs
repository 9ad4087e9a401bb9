//! The prefill worker's configuration: command-line flags, each with an environment variable.

use std::ffi::OsString;
use std::net::SocketAddr;

use duet_worker::WorkerArgs;

/// Everything a prefill worker needs to start.
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct PrefillConfig {
    /// Address to serve gRPC on (PrefillWorker, WorkerControl, KvEvents, health, reflection).
    #[arg(long, env = "DUET_PREFILL_LISTEN", default_value_t = PrefillConfig::default().listen)]
    pub listen: SocketAddr,
    /// The address others dial to reach this worker (default: the listen address).
    #[arg(long, env = "DUET_PREFILL_ADVERTISE")]
    pub advertise: Option<String>,
    /// A decode worker's KV transfer address (its --advertise, by default its gRPC address)
    /// that this worker may push KV to, besides the decode workers whose cards are in its
    /// cluster; a Prefill naming any other is refused (PERMISSION_DENIED). Repeat the flag, or
    /// give a comma-separated list in the environment variable.
    #[arg(
        long = "decode",
        value_name = "ADDR",
        env = "DUET_DECODE_WORKERS",
        value_delimiter = ','
    )]
    pub decode: Vec<String>,
    /// Most prompt tokens waiting to be computed; past it, `Prefill` answers RESOURCE_EXHAUSTED
    /// at once (a request arriving at an empty queue is always taken).
    #[arg(long, env = "DUET_PREFILL_MAX_QUEUED_TOKENS", default_value_t = PrefillConfig::default().max_queued_tokens)]
    pub max_queued_tokens: u64,
    /// The flags both workers take.
    #[command(flatten)]
    pub worker: WorkerArgs,
}

/// The flags' defaults (the flags take theirs from here).
impl Default for PrefillConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50061)),
            advertise: None,
            decode: Vec::new(),
            max_queued_tokens: 65536,
            worker: WorkerArgs::default(),
        }
    }
}

impl PrefillConfig {
    /// A configuration with every default, serving `model`.
    pub fn for_model(model: std::path::PathBuf) -> Self {
        Self {
            worker: WorkerArgs::for_model(model),
            ..Self::default()
        }
    }

    /// This configuration as the worker's command line (without the program name): parsed back,
    /// it gives `self`.
    pub fn to_args(&self) -> Vec<OsString> {
        let Self {
            listen,
            advertise,
            decode,
            max_queued_tokens,
            worker,
        } = self;
        let mut args: Vec<OsString> = vec![
            format!("--listen={listen}").into(),
            format!("--max-queued-tokens={max_queued_tokens}").into(),
        ];
        args.extend(advertise.iter().map(|a| format!("--advertise={a}").into()));
        args.extend(decode.iter().map(|a| format!("--decode={a}").into()));
        args.extend(worker.to_args());
        args
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        config: PrefillConfig,
    }

    #[test]
    fn defaults_and_flags() {
        let cli = Cli::try_parse_from(["duet-prefill", "--model", "m.gguf"]).unwrap();
        let c = cli.config;
        assert_eq!(c.listen.to_string(), "127.0.0.1:50061");
        assert_eq!(c.max_queued_tokens, 65536);
        assert_eq!(c.worker.engine.block_size, 16);

        let cli = Cli::try_parse_from([
            "duet-prefill",
            "--listen",
            "0.0.0.0:7000",
            "--worker-id",
            "p1",
            "--max-queued-tokens",
            "10",
            "--max-step-tokens",
            "64",
        ])
        .unwrap();
        assert_eq!(cli.config.worker.worker_id.as_deref(), Some("p1"));
        assert_eq!(cli.config.max_queued_tokens, 10);
        assert_eq!(cli.config.worker.engine.max_step_tokens, 64);
    }

    #[test]
    fn no_flags_give_the_default() {
        let c = Cli::try_parse_from(["duet-prefill"]).unwrap().config;
        assert_eq!(c, PrefillConfig::default());
    }

    /// Every field of its own differs from its default (the shared flags' round trip is
    /// `WorkerArgs`'s test), so a flag `to_args` leaves out fails the test.
    #[test]
    fn to_args_parses_back_to_the_same_config() {
        let c = PrefillConfig {
            listen: "0.0.0.0:7002".parse().unwrap(),
            advertise: Some("prefill.example:7002".into()),
            decode: vec!["d:1".into(), "d:2".into()],
            max_queued_tokens: 5,
            worker: WorkerArgs {
                worker_id: Some("p-7".into()),
                max_in_flight: 7,
                ..WorkerArgs::for_model("some dir/m.gguf".into())
            },
        };
        let argv = std::iter::once("duet-prefill".into()).chain(c.to_args());
        assert_eq!(Cli::try_parse_from(argv).unwrap().config, c);
    }
}
