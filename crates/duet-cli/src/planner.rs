//! `duet planner`: the planner at run time (`duet_planner_service`), a service of its own beside
//! the router. It takes the profile and the cluster's engine and router settings with the
//! flags `duet plan` takes them, checked the same way, and runs the loop until SIGTERM.

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use duet_engine::engine::EngineOptions;
use duet_planner::sim_worker::Sharing;
use duet_planner::simulator::Design;
use duet_planner_service::{Model, PlannerConfig};
use duet_router::RoutingOptions;
use duet_telemetry::TelemetryArgs;
use duet_transfer::choice::TransportChoice;

use crate::serve_args::ShapeArgs;
use crate::simulate::{TimingArgs, sim_config};

/// How the simulated workers share devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WorkerSharing {
    /// Each worker has its own device or cores (a deployment: one worker a pod).
    Dedicated,
    /// One process whose workers take turns on one kernel thread pool (`duet up`).
    TakeTurns,
    /// Processes on one machine sharing its cores (--machine-cores).
    Cores,
}

#[derive(Args, Debug)]
pub struct PlannerArgs {
    #[command(flatten)]
    pub timing: TimingArgs,
    /// How the workers share devices, as the simulation times them.
    #[arg(long, value_enum, env = "DUET_PLANNER_SHARING", default_value_t = WorkerSharing::Dedicated)]
    pub sharing: WorkerSharing,
    #[command(flatten)]
    pub planner: PlannerConfig,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// The KV transport between the workers (their --kv-transport).
    #[arg(long, env = "DUET_KV_TRANSPORT", default_value_t = TransportChoice::Auto)]
    pub kv_transport: TransportChoice,
    /// The workers' engine settings (the profile must be of them).
    #[command(flatten, next_help_heading = "Workers")]
    pub engine: EngineOptions,
    /// The router's routing settings (its flags of the same names).
    // Last: the heading applies to every flag after it.
    #[command(flatten, next_help_heading = "Router")]
    pub routing: RoutingOptions,
}

pub fn run(args: PlannerArgs) -> Result<()> {
    let _exporter = args.telemetry.init("duet-planner", std::io::stderr)?;
    let shape = ShapeArgs {
        launch: vec![Design::Disaggregated],
        prefill_workers: 0,
        decode_workers: 1,
        processes: args.sharing == WorkerSharing::Cores,
        kv_transport: args.kv_transport,
        engine: args.engine,
        routing: args.routing,
    };
    let profile = args
        .timing
        .load(&shape)
        .with_context(|| format!("--profile {}", args.timing.profile.display()))?;
    let mut sim = sim_config(
        &shape,
        Design::Disaggregated,
        &profile,
        args.planner.slo()?,
        args.timing.machine_cores,
        10.0,
    );
    if args.sharing == WorkerSharing::Dedicated {
        sim.sharing = Sharing::Dedicated;
    }
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(duet_planner_service::serve(
        args.planner,
        Model { profile, sim },
        duet_proto::serve::terminated(),
    ))?;
    Ok(())
}
