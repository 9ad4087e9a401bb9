//! Progress of long jobs (downloads, checksums, benchmark runs): an indicatif bar on a terminal,
//! and plain lines at every quarter when stderr is not one (CI logs, pipes).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};

use indicatif::{ProgressBar, ProgressStyle};

/// What a job counts.
#[derive(Clone, Copy, Debug)]
pub enum Unit {
    Bytes,
    Requests,
    /// Points of a measurement grid.
    Measurements,
}

pub struct Progress {
    label: String,
    total: u64,
    unit: Unit,
    /// A drawn bar when stderr is a terminal.
    bar: Option<ProgressBar>,
    done: AtomicU64,
    /// Quarters already reported as lines.
    reported: AtomicU64,
}

impl Progress {
    pub fn new(label: impl Into<String>, total: u64, unit: Unit) -> Self {
        let label = label.into();
        let bar = std::io::stderr().is_terminal().then(|| {
            let template = match unit {
                Unit::Bytes => "{msg} {wide_bar} {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
                Unit::Requests => "{msg} {wide_bar} {pos}/{len} requests ({elapsed})",
                Unit::Measurements => {
                    "{msg} {wide_bar} {pos}/{len} measurements ({elapsed}, {eta} left)"
                }
            };
            let bar = ProgressBar::new(total);
            bar.set_style(ProgressStyle::with_template(template).expect("valid template"));
            bar.set_message(label.clone());
            bar
        });
        Self {
            label,
            total,
            unit,
            bar,
            done: AtomicU64::new(0),
            reported: AtomicU64::new(0),
        }
    }

    pub fn inc(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        match &self.bar {
            Some(bar) => bar.inc(n),
            None => {
                let quarter = done * 4 / self.total.max(1);
                if self.reported.fetch_max(quarter, Ordering::Relaxed) < quarter {
                    eprintln!("{}: {}", self.label, self.describe(done));
                }
            }
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }

    fn describe(&self, done: u64) -> String {
        let pct = done * 100 / self.total.max(1);
        match self.unit {
            Unit::Bytes => format!(
                "{pct}% ({:.1} of {:.1} MiB)",
                done as f64 / (1 << 20) as f64,
                self.total as f64 / (1 << 20) as f64
            ),
            Unit::Requests => format!("{pct}% ({done} of {} requests)", self.total),
            Unit::Measurements => format!("{pct}% ({done} of {} measurements)", self.total),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_report_each_quarter_once() {
        let p = Progress {
            label: "x".into(),
            total: 100,
            unit: Unit::Requests,
            bar: None,
            done: AtomicU64::new(0),
            reported: AtomicU64::new(0),
        };
        for _ in 0..100 {
            p.inc(1);
        }
        assert_eq!(p.reported.load(Ordering::Relaxed), 4);
        assert_eq!(p.describe(50), "50% (50 of 100 requests)");
    }
}
