//! `duet`: fetch the default model, generate text, benchmark the engine.

mod bandwidth;
mod bench_engine;
mod bench_gpu;
mod bench_kv_dtype;
mod bench_kv_pull;
mod bench_serve;
mod bench_structured;
mod bench_transfer;
mod chaos;
mod fetch;
mod generate;
mod health;
mod in_process;
mod plan;
mod planner;
mod plot;
mod profile;
mod profile_served;
mod progress;
mod serve_args;
mod serve_report;
mod shared_prefix;
mod simulate;
mod up;

use duet_cli::cluster;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "duet", version, about = "Disaggregated LLM serving: prefill and decode pools", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Manage model files.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Generate text from a prompt, streaming it as it is made (in this process, or through a
    /// running cluster with --server).
    Generate(Box<generate::GenerateArgs>),
    /// Run a whole cluster on loopback: router + prefill + decode workers.
    Up(Box<up::UpArgs>),
    /// One gRPC health check of a duet service (exit 0 when SERVING): for exec probes of
    /// ports that require a client certificate.
    Health(health::HealthArgs),
    /// Measure the engine on this device (prefill over tokens × cached prefix, decode over
    /// batch × context, KV transfer per transport) and fit DistServe's latency forms: the
    /// profile `duet simulate` and `duet plan` time clusters by.
    Profile(Box<profile::ProfileArgs>),
    /// Simulate a cluster from a profile: the router's real policy and the engine's real
    /// scheduler, timed by the profile; the flags of `duet bench serve`, and its JSON report.
    Simulate(Box<simulate::SimulateArgs>),
    /// Search placements (colocated, every prefill:decode split, step budgets) for the most
    /// goodput per device by simulation, as DistServe does; write the winner as Helm values.
    Plan(Box<plan::PlanArgs>),
    /// The planner at run time, a service beside the router: re-plans the prefill:decode split
    /// from the live load each period and at once on a burst, publishes the desired replicas
    /// per role (/metrics) for the chart's autoscalers, switches workers' roles toward the best
    /// split, and logs every decision.
    Planner(Box<planner::PlannerArgs>),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Download the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) into the models directory.
    Fetch(fetch::FetchArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Prefill and decode throughput of the engine alone (no services).
    Engine(Box<bench_engine::EngineBenchArgs>),
    /// Load a cluster through its router: TTFT, TPOT, ITL, end-to-end latency, SLO attainment,
    /// goodput; disaggregated and colocated side by side.
    Serve(Box<bench_serve::ServeBenchArgs>),
    /// The gRPC KV transport alone: a prompt's KV pushed into a real decode worker.
    Transfer(bench_transfer::TransferBenchArgs),
    /// The GPU checks and timings: CUDA vs CPU, paged attention vs a reference, a
    /// Llama-3-8B-shaped model against the bandwidth and matrix-rate rooflines.
    Gpu(bench_gpu::GpuBenchArgs),
    /// A KV cache type (int8) against a reference (f16) on one model, on the CPU: logits and
    /// greedy tokens over long generations, and decode speed at a long context.
    KvDtype(Box<bench_kv_dtype::KvDtypeBenchArgs>),
    /// What structured outputs cost: TPOT of a batch decoding under a nested JSON Schema
    /// against the same batch unconstrained, token for token.
    Structured(Box<bench_structured::StructuredBenchArgs>),
    /// A prefix pulled from a peer decode worker against the same length computed: the
    /// second worker's time to first token both ways.
    KvPull(Box<bench_kv_pull::KvPullBenchArgs>),
}

fn main() {
    // Parsed through the matches so that commands can tell a flag given from its default.
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let result = match cli.command {
        Command::Model {
            command: ModelCommand::Fetch(args),
        } => fetch::run(args),
        Command::Generate(args) => generate::run(*args),
        Command::Up(args) => up::run(*args),
        Command::Health(args) => health::run(args),
        Command::Profile(args) => profile::run(*args),
        Command::Simulate(args) => simulate::run(*args),
        Command::Plan(args) => plan::run(*args),
        Command::Planner(args) => planner::run(*args),
        Command::Bench {
            command: BenchCommand::Engine(args),
        } => {
            let given = given(&matches, &["bench", "engine"], "kv_cache_tokens");
            bench_engine::run(*args, given)
        }
        Command::Bench {
            command: BenchCommand::Serve(args),
        } => bench_serve::run(*args),
        Command::Bench {
            command: BenchCommand::Transfer(args),
        } => bench_transfer::run(args),
        Command::Bench {
            command: BenchCommand::Gpu(args),
        } => bench_gpu::run(args),
        Command::Bench {
            command: BenchCommand::KvDtype(args),
        } => bench_kv_dtype::run(*args),
        Command::Bench {
            command: BenchCommand::Structured(args),
        } => bench_structured::run_bench(*args),
        Command::Bench {
            command: BenchCommand::KvPull(args),
        } => bench_kv_pull::run(*args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Whether argument `id` of the subcommand at `path` was set on the command line or through its
/// environment variable, rather than left at its default.
fn given(matches: &ArgMatches, path: &[&str], id: &str) -> bool {
    let sub = path
        .iter()
        .try_fold(matches, |m, name| m.subcommand_matches(name));
    sub.and_then(|m| m.value_source(id))
        .is_some_and(|s| s != ValueSource::DefaultValue)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn up_takes_the_router_flags() {
        let cli = Cli::try_parse_from(["duet", "up", "--local-prefill-threshold=7"]).unwrap();
        let Command::Up(args) = cli.command else {
            panic!("not `up`")
        };
        assert_eq!(args.routing.local_prefill_threshold, 7);
    }

    #[test]
    fn a_flag_given_is_told_from_its_default() {
        let engine = ["bench", "engine"];
        let matches = Cli::command().get_matches_from(["duet", "bench", "engine"]);
        assert!(!given(&matches, &engine, "kv_cache_tokens"));
        let matches =
            Cli::command().get_matches_from(["duet", "bench", "engine", "--kv-cache-tokens=64"]);
        assert!(given(&matches, &engine, "kv_cache_tokens"));
    }
}
