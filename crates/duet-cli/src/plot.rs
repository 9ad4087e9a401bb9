//! `duet bench serve --plot-out FILE.svg` (and `duet simulate --plot-out`): the runs' latency percentiles as an SVG chart
//! (plotters): time to first token and time per output token side by side, p50 / p90 / p99 bars
//! per design, with axes, labels and a legend.

use std::path::Path;

use anyhow::{Context, Result, bail};
use plotters::prelude::*;

use duet_planner::report::ServeSummary;

const SIZE: (u32, u32) = (1000, 460);
const QUANTILES: [&str; 3] = ["p50", "p90", "p99"];
const COLORS: [RGBColor; 3] = [
    RGBColor(66, 133, 244),
    RGBColor(251, 188, 5),
    RGBColor(219, 68, 55),
];

/// Writes the chart of `runs` to `out` (an `.svg` path).
pub fn latency_percentiles(runs: &[ServeSummary], out: &Path) -> Result<()> {
    if out.extension().is_none_or(|e| e != "svg") {
        bail!(
            "--plot-out {}: the chart is written as SVG; name the file *.svg",
            out.display()
        );
    }
    draw(runs, out)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("writing the chart {}", out.display()))
}

type Metric = fn(&ServeSummary) -> [f64; 3];

fn draw(runs: &[ServeSummary], out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(out, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled("Latency percentiles by design", ("sans-serif", 22))?;
    let panels: [(&str, Metric); 2] = [
        ("Time to first token (ms)", |r| {
            [r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99]
        }),
        ("Time per output token (ms)", |r| {
            [r.tpot_ms.p50, r.tpot_ms.p90, r.tpot_ms.p99]
        }),
    ];
    let areas = root.split_evenly((1, 2));
    for (area, (title, metric)) in areas.iter().zip(panels) {
        let max = runs
            .iter()
            .flat_map(metric)
            .fold(0.0f64, f64::max)
            .max(1e-3);
        let designs: Vec<&str> = runs.iter().map(|r| r.design.as_str()).collect();
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0f64..designs.len().max(1) as f64, 0f64..max * 1.15)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(designs.len().max(1))
            .x_label_formatter(&|x| {
                designs
                    .get(x.floor() as usize)
                    .map(|d| d.to_string())
                    .unwrap_or_default()
            })
            .y_desc("milliseconds")
            .draw()?;
        for (q, (name, color)) in QUANTILES.iter().zip(COLORS).enumerate() {
            let bars = runs.iter().enumerate().map(move |(i, r)| {
                let x0 = i as f64 + 0.15 + 0.23 * q as f64;
                Rectangle::new([(x0, 0.0), (x0 + 0.21, metric(r)[q])], color.filled())
            });
            chart.draw_series(bars)?.label(*name).legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
            });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
