//! Flags of the decode worker (each also an environment variable).

use std::ffi::OsString;
use std::net::SocketAddr;

use duet_cluster::Role;
use duet_engine::device::Switch;
use duet_worker::WorkerArgs;

#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct DecodeConfig {
    /// Address to serve DecodeWorker, KvTransfer, KvEvents and WorkerControl on.
    #[arg(long, env = "DUET_DECODE_LISTEN", default_value_t = DecodeConfig::default().listen)]
    pub listen: SocketAddr,
    /// The address others dial to reach this worker, and prefill workers push KV to (default:
    /// the listen address).
    #[arg(long, env = "DUET_DECODE_ADVERTISE")]
    pub advertise: Option<String>,
    /// A prefill worker's gRPC address (its --advertise) that a prefill plan may name, besides
    /// the prefill workers whose cards are in this worker's cluster; a Decode whose plan names
    /// any other is refused (PERMISSION_DENIED). Repeat the flag, or give a comma-separated list
    /// in the environment variable.
    #[arg(
        long = "prefill",
        value_name = "ADDR",
        env = "DUET_PREFILL_WORKERS",
        value_delimiter = ','
    )]
    pub prefill: Vec<String>,
    /// How long KV blocks reserved for a transfer are held before they are reclaimed, in
    /// milliseconds.
    #[arg(long, env = "DUET_RESERVATION_TIMEOUT_MS", default_value_t = DecodeConfig::default().reservation_timeout_ms)]
    pub reservation_timeout_ms: u64,
    /// Longest a single prefill attempt may take before the next prefill worker is tried, in
    /// milliseconds.
    #[arg(long, env = "DUET_PREFILL_TIMEOUT_MS", default_value_t = DecodeConfig::default().prefill_timeout_ms)]
    pub prefill_timeout_ms: u64,
    /// Pulling prefixes from peers.
    #[command(flatten)]
    pub peer_pull: PeerPullArgs,
    /// Switching the worker's role at run time.
    #[command(flatten)]
    pub role_switch: RoleSwitchArgs,
    /// The flags both workers take.
    #[command(flatten)]
    pub worker: WorkerArgs,
}

/// Whether a decode worker pulls prefixes from its peers (also a flag of `duet up` and `duet
/// bench serve`).
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct PeerPullArgs {
    /// Pull a prefix another decode worker of the cluster holds (in any tier) when the router
    /// expects moving it to beat computing it: over KvTransfer/Pull, checked as a push is
    /// (checksums, fingerprint, the reservation bound to that peer). A pull that fails, finds
    /// the prefix gone, or outlasts computing it falls back to computing it, counted, never
    /// failing the request. Peers are the decode cards of this worker's cluster.
    #[arg(long, env = "DUET_KV_PEER_PULL", value_enum, default_value_t = Switch::Off)]
    pub kv_peer_pull: Switch,
    /// Ask for pulls over CUDA IPC, on or off: where this worker offers cuda-ipc
    /// (`--kv-transport auto|cuda-ipc` on a GPU) and the holder is a GPU worker on this node,
    /// the holder copies the blocks device to device straight into this worker's reservation
    /// (the header, fingerprint and reservation checked as for a cuda-ipc push); a holder that
    /// cannot answers over gRPC. A failed CUDA-IPC pull is asked again over gRPC, then computed,
    /// each counted. Off until it has run on a GPU.
    #[arg(long, env = "DUET_KV_PEER_PULL_CUDA_IPC", value_enum, default_value_t = Switch::Off)]
    pub kv_peer_pull_cuda_ipc: Switch,
}

impl PeerPullArgs {
    pub fn on(&self) -> bool {
        self.kv_peer_pull.is_on()
    }

    /// These flags as a command line.
    pub fn to_args(&self) -> Vec<OsString> {
        vec![
            format!("--kv-peer-pull={}", self.kv_peer_pull).into(),
            format!("--kv-peer-pull-cuda-ipc={}", self.kv_peer_pull_cuda_ipc).into(),
        ]
    }
}

/// Whether the worker's role can change at run time.
#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct RoleSwitchArgs {
    /// Make this worker's role switchable at run time: it also serves the prefill worker's
    /// PrefillWorker on the same engine and weights, and WorkerAdmin/SwitchRole (cluster token
    /// and mTLS like every worker RPC), which drains it (no request lost), switches it between
    /// decode and prefill and registers its card again under the new role; the run-time
    /// planner calls it. The router learns of the new role from the card, so the worker needs
    /// the cluster's registry (--etcd, or the embedded one of `duet up`).
    #[arg(long, env = "DUET_ROLE_SWITCH", value_enum, default_value_t = Switch::Off)]
    pub role_switch: Switch,
    /// The role a switchable worker starts in (prefill only with --role-switch on).
    #[arg(long, env = "DUET_INITIAL_ROLE", value_enum, default_value_t = Role::Decode)]
    pub initial_role: Role,
    /// In the prefill role: most prompt tokens waiting to be computed; past it, `Prefill`
    /// answers RESOURCE_EXHAUSTED at once (the prefill worker's --max-queued-tokens).
    #[arg(long, env = "DUET_PREFILL_MAX_QUEUED_TOKENS", default_value_t = RoleSwitchArgs::default().prefill_max_queued_tokens)]
    pub prefill_max_queued_tokens: u64,
}

impl Default for RoleSwitchArgs {
    fn default() -> Self {
        Self {
            role_switch: Switch::Off,
            initial_role: Role::Decode,
            prefill_max_queued_tokens: duet_prefill_worker::PrefillConfig::default()
                .max_queued_tokens,
        }
    }
}

impl RoleSwitchArgs {
    pub fn on(&self) -> bool {
        self.role_switch.is_on()
    }

    /// The role the worker starts in: prefill only when its role can switch.
    pub fn initial_role(&self) -> anyhow::Result<Role> {
        anyhow::ensure!(
            self.on() || self.initial_role == Role::Decode,
            "--initial-role prefill needs --role-switch on: a duet-decode worker serves as a \
             prefill worker only when its role can switch (else run duet-prefill)"
        );
        Ok(self.initial_role)
    }

    /// These flags as a command line.
    pub fn to_args(&self) -> Vec<OsString> {
        vec![
            format!("--role-switch={}", self.role_switch).into(),
            format!("--initial-role={}", self.initial_role.as_str()).into(),
            format!(
                "--prefill-max-queued-tokens={}",
                self.prefill_max_queued_tokens
            )
            .into(),
        ]
    }
}

/// The flags' defaults (the flags take theirs from here).
impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50071)),
            advertise: None,
            prefill: Vec::new(),
            reservation_timeout_ms: 30_000,
            prefill_timeout_ms: 60_000,
            peer_pull: PeerPullArgs::default(),
            role_switch: RoleSwitchArgs::default(),
            worker: WorkerArgs::default(),
        }
    }
}

impl DecodeConfig {
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
            prefill,
            reservation_timeout_ms,
            prefill_timeout_ms,
            peer_pull,
            role_switch,
            worker,
        } = self;
        let mut args: Vec<OsString> = vec![
            format!("--listen={listen}").into(),
            format!("--reservation-timeout-ms={reservation_timeout_ms}").into(),
            format!("--prefill-timeout-ms={prefill_timeout_ms}").into(),
        ];
        args.extend(advertise.iter().map(|a| format!("--advertise={a}").into()));
        args.extend(prefill.iter().map(|a| format!("--prefill={a}").into()));
        args.extend(peer_pull.to_args());
        args.extend(role_switch.to_args());
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
        config: DecodeConfig,
    }

    #[test]
    fn no_flags_give_the_default() {
        let c = Cli::try_parse_from(["duet-decode"]).unwrap().config;
        assert_eq!(c, DecodeConfig::default());
    }

    /// Every field of its own differs from its default (the shared flags' round trip is
    /// `WorkerArgs`'s test), so a flag `to_args` leaves out fails the test.
    #[test]
    fn to_args_parses_back_to_the_same_config() {
        let c = DecodeConfig {
            listen: "0.0.0.0:7003".parse().unwrap(),
            advertise: Some("decode.example:7003".into()),
            prefill: vec!["p:1".into(), "p:2".into()],
            reservation_timeout_ms: 1,
            prefill_timeout_ms: 2,
            peer_pull: PeerPullArgs {
                kv_peer_pull: Switch::On,
                kv_peer_pull_cuda_ipc: Switch::On,
            },
            role_switch: RoleSwitchArgs {
                role_switch: Switch::On,
                initial_role: Role::Prefill,
                prefill_max_queued_tokens: 4,
            },
            worker: WorkerArgs {
                worker_id: Some("d-7".into()),
                request_timeout_ms: 3,
                ..WorkerArgs::for_model("some dir/m.gguf".into())
            },
        };
        let argv = std::iter::once("duet-decode".into()).chain(c.to_args());
        assert_eq!(Cli::try_parse_from(argv).unwrap().config, c);
    }
}
