//! What `duet bench serve` and `duet simulate` print of their runs: one table, and the time to
//! first token split as the servers saw it (or as the simulator timed it).

use duet_planner::arrivals::Arrivals;
use duet_planner::report::ServeSummary;

use crate::serve_args::{WorkloadArgs, WorkloadShape};

/// One run's line of the table.
pub struct TableRow<'a> {
    pub summary: &'a ServeSummary,
    /// Closed loop: output tokens/s while every client had a request in flight.
    pub full_tokens_per_s: Option<f64>,
    /// Prompt tokens found in a prefix cache ÷ prompt tokens.
    pub hit: f64,
    /// The same for an ideal cache, where known.
    pub ideal: Option<f64>,
}

/// The workload line, then a line per run.
pub fn print_table(rows: &[TableRow], workload: &WorkloadArgs, arrivals: Arrivals) {
    let prompts = match (workload.workload, &workload.trace) {
        (_, Some(trace)) => format!("trace {}", trace.display()),
        (WorkloadShape::Random, None) => format!("prompt {} tokens", workload.prompt_tokens),
        (WorkloadShape::SharedPrefix, None) => {
            let p = &workload.shared_prefix;
            format!(
                "shared prefix: {} groups × {} users × {} turns, {}-token system prompts, {}-token questions",
                p.groups, p.users, p.turns, p.system_tokens, p.question_tokens
            )
        }
    };
    let arrivals = match arrivals {
        Arrivals::Closed { concurrency } => format!("concurrency {concurrency}"),
        Arrivals::Poisson { rate } => format!("Poisson {rate} req/s"),
        Arrivals::Gamma { rate, cv } => format!("gamma {rate} req/s, CV {cv}"),
        Arrivals::Sinusoidal {
            rate,
            amplitude,
            period_s,
        } => format!("{rate} req/s ± {:.0}% over {period_s} s", amplitude * 100.0),
        Arrivals::Trace { speedup } => format!("the trace's timestamps ÷ {speedup}"),
    };
    println!(
        "workload: {} requests, {arrivals}, {prompts}, output {} tokens; SLO: TTFT ≤ {} ms, TPOT ≤ {} ms",
        rows.first().map_or(0, |r| r.summary.requests),
        workload.output_tokens,
        workload.ttft_slo_ms,
        workload.tpot_slo_ms
    );
    println!(
        "{:<27} {:>6} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>8} {:>9} {:>6} {:>6}",
        "design",
        "failed",
        "shed",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "TPOT p50",
        "TPOT p90",
        "ITL p99",
        "out tok/s",
        "full tok/s",
        "SLO att",
        "goodput",
        "hit",
        "ideal"
    );
    let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.0}%", v * 100.0));
    for row in rows {
        let r = row.summary;
        println!(
            "{:<27} {:>6} {:>5} {:>9.1} {:>9.1} {:>9.1} {:>9.2} {:>9.2} {:>9.2} {:>10.1} {:>10} {:>7.0}% {:>9.2} {:>6} {:>6}",
            r.design,
            r.failed,
            r.shed,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.tpot_ms.p50,
            r.tpot_ms.p90,
            r.itl_ms.p99,
            r.output_tokens_per_s,
            row.full_tokens_per_s
                .map_or("-".into(), |f| format!("{f:.1}")),
            r.slo_attainment * 100.0,
            r.goodput_rps,
            pct(Some(row.hit)),
            pct(row.ideal)
        );
    }
}

/// A line per run: the p50 of each part of the time to first token.
pub fn print_ttft_split<'a>(runs: impl IntoIterator<Item = &'a ServeSummary>) {
    for r in runs {
        let b = &r.server_ttft_ms;
        println!(
            "{:<27} TTFT p50 as the servers saw it: queue {:.1} + prefill {:.1} + transfer {:.1} ms; router TTFT {:.1} ms",
            r.design, b.queue_ms.p50, b.prefill_ms.p50, b.transfer_ms.p50, b.ttft_ms.p50
        );
    }
}
