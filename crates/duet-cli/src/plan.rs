//! `duet plan`: DistServe's placement search (`duet_planner::search`) over a profile and a
//! workload: every placement's highest rate within the SLOs, the winner written as Helm values,
//! a table per placement, and attainment against rate as a chart.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use duet_engine::device::Device;
use duet_planner::profile::Profile;
use duet_planner::search::{self, Objective, SearchSettings, Searched};
use duet_planner::simulator::Design;
use duet_planner::workload::Job;
use plotters::prelude::*;
use serde::Serialize;

use crate::progress::{Progress, Unit};
use crate::serve_args::{ShapeArgs, WorkloadArgs, WorkloadReport};
use crate::simulate::{TimingArgs, resolved_threads, sim_config};

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub timing: TimingArgs,
    /// Devices to place the cluster on: GPUs, or on a CPU machine the workers it runs.
    #[arg(long)]
    pub devices: usize,
    /// Largest unit simulated; the best unit is replicated over --devices (DistServe's way: a
    /// 64-device search in minutes).
    #[arg(long, default_value_t = 8)]
    pub max_unit_devices: usize,
    /// Step token budgets (--max-step-tokens: the prefill chunk and the batch cap) tried.
    /// Default: half, once and twice the cluster's --max-step-tokens.
    #[arg(long, value_delimiter = ',')]
    pub step_tokens: Vec<usize>,
    /// Share of requests that must meet both SLOs (DistServe's 90%; MLPerf's server scenario
    /// holds the 99th percentile: 0.99).
    #[arg(long, default_value_t = 0.9)]
    pub attainment: f64,
    /// What the winner maximises: goodput per device, or the devices' goodput together (one
    /// machine whose workers share its cores).
    #[arg(long, value_enum, default_value_t = Objective::PerDevice)]
    pub objective: Objective,
    /// Bisection steps per placement, once its rate is bracketed.
    #[arg(long, default_value_t = 6)]
    pub iterations: usize,
    /// Write the winner as a Helm values file here (`helm install -f FILE`).
    #[arg(long)]
    pub values_out: Option<PathBuf>,
    /// Write the report (every placement and every rate simulated) as JSON here.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Write a chart of attainment against rate for the best placements here (FILE.svg).
    #[arg(long)]
    pub plot_out: Option<PathBuf>,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// The cluster's settings; the search varies the design, the pools and --max-step-tokens (a
    /// colocated placement prefills every prompt on its workers).
    // Last: its router heading applies to every flag after it.
    #[command(flatten, next_help_heading = "Cluster")]
    pub shape: ShapeArgs,
}

#[derive(Serialize)]
struct PlanReport<'a> {
    workload: WorkloadReport<'a>,
    profile: String,
    devices: usize,
    settings: SearchSettings,
    objective: Objective,
    placements: Vec<Searched>,
    winner: Option<String>,
}

pub fn run(args: PlanArgs) -> Result<()> {
    if args.devices == 0 {
        bail!("--devices must be at least 1");
    }
    let profile = args.timing.load(&args.shape)?;
    let arrivals = args.workload.arrivals()?;
    let slo = args.workload.slo()?;
    let jobs: Vec<Job> = args.workload.jobs()?.collect::<Result<_, _>>()?;
    let steps = match args.step_tokens.is_empty() {
        true => {
            let s = args.shape.engine.step_tokens();
            vec![(s / 2).max(1), s, s * 2]
        }
        false => args.step_tokens.clone(),
    };
    let candidates = search::candidates(args.max_unit_devices.min(args.devices), &steps);
    let base = sim_config(
        &args.shape,
        Design::Disaggregated,
        &profile,
        slo,
        args.timing.machine_cores,
        args.workload.timeline_window_s,
    );
    let settings = SearchSettings {
        attainment: args.attainment,
        iterations: args.iterations,
        start_rate: args.workload.rate.unwrap_or(1.0),
        devices: args.devices,
        seed: args.workload.seed,
    };
    let progress = Progress::new("plan", candidates.len() as u64, Unit::Measurements);
    let mut first = true;
    let results = search::search(
        &profile,
        &base,
        &candidates,
        &jobs,
        arrivals,
        &settings,
        &mut |_| {
            if !std::mem::take(&mut first) {
                progress.inc(1);
            }
        },
    )?;
    progress.inc(1);
    progress.finish();
    let winner = search::best(&results, args.objective);
    print_table(&results, winner, &args);
    if let (Some(w), Some(out)) = (winner, &args.values_out) {
        write_values(w, &args, &profile, out)?;
        eprintln!("Helm values written to {}", out.display());
    }
    if let Some(out) = &args.plot_out {
        plot_attainment(&results, args.objective, args.attainment, out)?;
        eprintln!("plot written to {}", out.display());
    }
    let report = PlanReport {
        workload: args.workload.report(jobs.len(), arrivals),
        profile: args.timing.profile.display().to_string(),
        devices: args.devices,
        settings,
        objective: args.objective,
        winner: winner.map(|w| w.name.clone()),
        placements: results.clone(),
    };
    if let Some(out) = &args.json_out {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(out, json).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

fn print_table(results: &[Searched], winner: Option<&Searched>, args: &PlanArgs) {
    println!(
        "placements for {} devices: the highest rate with {:.0}% of requests within TTFT ≤ {} ms and TPOT ≤ {} ms",
        args.devices,
        args.attainment * 100.0,
        args.workload.ttft_slo_ms,
        args.workload.tpot_slo_ms
    );
    println!(
        "{:<28} {:>7} {:>10} {:>12} {:>8} {:>11} {:>11} {:>11}",
        "placement",
        "devices",
        "max req/s",
        "per device",
        "replicas",
        "total req/s",
        "TTFT p90",
        "TPOT p90"
    );
    for r in results {
        let at = r.curve.iter().find(|p| p.rate == r.max_rate);
        let mark = if winner.is_some_and(|w| w.name == r.name) {
            " ←"
        } else {
            ""
        };
        println!(
            "{:<28} {:>7} {:>10.3} {:>12.3} {:>8} {:>11.3} {:>11} {:>11}{mark}",
            r.name,
            r.candidate.devices(),
            r.max_rate,
            r.goodput_per_device,
            r.replicas,
            r.total_rate,
            at.map_or("-".into(), |p| format!("{:.1} ms", p.ttft_p90_ms)),
            at.map_or("-".into(), |p| format!("{:.2} ms", p.tpot_p90_ms)),
        );
    }
}

/// The winner as chart values: its pools' replicas and their flags.
fn write_values(w: &Searched, args: &PlanArgs, profile: &Profile, out: &Path) -> Result<()> {
    let c = &w.candidate;
    let mut flags = vec![format!("--max-step-tokens={}", c.max_step_tokens)];
    if args.shape.engine.device == Device::Cpu {
        flags.push(format!(
            "--threads={}",
            resolved_threads(args.shape.engine.threads)
        ));
    }
    let flags = flags.join(", ");
    let threshold = match c.design {
        Design::Colocated => u32::MAX,
        Design::Disaggregated => args.shape.routing.local_prefill_threshold,
    };
    let mut v = String::new();
    writeln!(
        v,
        "# Written by `duet plan`: {}, replicated {}× over {} devices: {:.3} requests/s per device, \
         {:.3} in all,\n# with {:.0}% of requests within TTFT ≤ {} ms and TPOT ≤ {} ms (simulated).",
        w.name,
        w.replicas,
        args.devices,
        w.goodput_per_device,
        w.total_rate,
        args.attainment * 100.0,
        args.workload.ttft_slo_ms,
        args.workload.tpot_slo_ms
    )?;
    writeln!(
        v,
        "# Profile: {} ({} on {}, {} threads, commit {}).",
        args.timing.profile.display(),
        profile.model.name,
        profile.device.name,
        profile.flags.threads,
        profile.commit
    )?;
    writeln!(
        v,
        "prefill:\n  replicas: {}\n  extraArgs: [{flags}]",
        c.prefill * w.replicas
    )?;
    writeln!(
        v,
        "decode:\n  replicas: {}\n  extraArgs: [{flags}]",
        c.decode * w.replicas
    )?;
    writeln!(
        v,
        "router:\n  extraArgs: [--local-prefill-threshold={threshold}]"
    )?;
    std::fs::write(out, v).with_context(|| format!("writing {}", out.display()))
}

/// Attainment against rate for the best placements (at most eight, by the objective), with the
/// target as a line.
fn plot_attainment(
    results: &[Searched],
    objective: Objective,
    target: f64,
    out: &Path,
) -> Result<()> {
    if out.extension().is_none_or(|e| e != "svg") {
        bail!(
            "--plot-out {}: the chart is written as SVG; name the file *.svg",
            out.display()
        );
    }
    let mut ranked: Vec<&Searched> = results.iter().collect();
    ranked.sort_by(|a, b| {
        let key = |s: &Searched| match objective {
            Objective::PerDevice => s.goodput_per_device,
            Objective::Total => s.total_rate,
        };
        key(b).total_cmp(&key(a))
    });
    ranked.truncate(8);
    draw(&ranked, target, out)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("writing the chart {}", out.display()))
}

const COLORS: [RGBColor; 8] = [
    RGBColor(66, 133, 244),
    RGBColor(219, 68, 55),
    RGBColor(244, 180, 0),
    RGBColor(15, 157, 88),
    RGBColor(171, 71, 188),
    RGBColor(0, 172, 193),
    RGBColor(255, 112, 67),
    RGBColor(158, 157, 36),
];

fn draw(series: &[&Searched], target: f64, out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let max_rate = series
        .iter()
        .flat_map(|s| s.curve.iter().map(|p| p.rate))
        .fold(0.0, f64::max)
        .max(1e-3);
    let root = SVGBackend::new(out, (1000, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "SLO attainment against request rate (simulated)",
            ("sans-serif", 22),
        )
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_rate * 1.05, 0.0..1.02)?;
    chart
        .configure_mesh()
        .x_desc("requests per second (one unit of the placement)")
        .y_desc("share of requests within both SLOs")
        .draw()?;
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(0.0, target), (max_rate * 1.05, target)],
            BLACK.stroke_width(1),
        )))?
        .label(format!("target {:.0}%", target * 100.0))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut points: Vec<(f64, f64)> = s.curve.iter().map(|p| (p.rate, p.attainment)).collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(std::iter::once(PathElement::new(
                points.clone(),
                color.stroke_width(2),
            )))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 3, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerLeft)
        .draw()?;
    root.present()?;
    Ok(())
}
