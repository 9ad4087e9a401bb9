//! The decision log: every re-plan as one JSON record (its trigger, the live inputs, each split
//! simulated, what was chosen and why, the switch made), written when it is made and again,
//! with the latencies observed over the period after it, at the next re-plan. Appended as JSON
//! lines to `--decisions-out`, and served as a JSON array on `/decisions`.

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;

use crate::decide::{Desired, Prediction, Split, SplitChoice, SwitchStep};
use crate::live::Observed;

/// Decisions `/decisions` keeps (the file keeps them all).
const KEPT: usize = 256;

/// One re-plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// Numbered from 1 in this planner's life.
    pub id: u64,
    /// Seconds since the Unix epoch.
    pub at: f64,
    /// `period` or `burst`.
    pub trigger: &'static str,
    /// `stay`, `switch`, `blocked` (a move no worker could make) or `idle` (nothing to plan).
    pub action: &'static str,
    pub reason: String,
    /// The live rate (requests per second): the period's, or the burst window's when higher.
    pub rate: f64,
    /// The rate the split and the desired replicas are chosen for: `rate` × (1 + --headroom).
    pub planned_rate: f64,
    /// The live latencies over the period before the decision.
    pub observed_before: Observed,
    /// Requests waiting in the workers' queues (replayed first in simulation).
    pub backlog: usize,
    /// What scaled the profile's KV transfer times to the live ones (1: none).
    pub transfer_scale: f64,
    pub live: Split,
    /// Every split of the live workers simulated at the planned rate, the live one included.
    pub predictions: Vec<Prediction>,
    /// The split chosen for the live workers and its prediction.
    pub chosen: Option<Prediction>,
    pub desired: Option<Desired>,
    pub switch: Option<SwitchStep>,
    /// Why the switch failed (it is tried again at the next re-plan).
    pub switch_error: Option<String>,
    /// The live latencies over the period after the decision: set at the next re-plan.
    pub observed: Option<Observed>,
}

impl Decision {
    /// A re-plan of `live` at `rate`, made now, that has decided nothing yet (`idle`).
    pub fn new(
        id: u64,
        trigger: &'static str,
        rate: f64,
        live: Split,
        observed_before: Observed,
        backlog: usize,
    ) -> Self {
        Self {
            id,
            at: std::time::SystemTime::now()
                .duration_since(std::time::SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            trigger,
            action: "idle",
            reason: String::new(),
            rate,
            planned_rate: rate,
            observed_before,
            backlog,
            transfer_scale: 1.0,
            live,
            predictions: Vec::new(),
            chosen: None,
            desired: None,
            switch: None,
            switch_error: None,
            observed: None,
        }
    }

    /// The action of a re-plan that chose `choice`.
    pub fn action_of(choice: &SplitChoice) -> &'static str {
        match choice {
            SplitChoice::Stay { .. } => "stay",
            SplitChoice::Move { .. } => "switch",
        }
    }
}

/// Where decisions go.
#[derive(Debug)]
pub struct DecisionLog {
    file: Option<(PathBuf, Mutex<std::fs::File>)>,
    kept: Mutex<VecDeque<Decision>>,
}

/// A decision log file that cannot be written.
#[derive(Debug, thiserror::Error)]
#[error("--decisions-out {path}: {source}")]
pub struct DecisionLogError {
    path: String,
    #[source]
    source: std::io::Error,
}

impl DecisionLog {
    /// A log appending to `file` when given (created if missing).
    pub fn open(file: Option<&Path>) -> Result<Self, DecisionLogError> {
        let file = match file {
            None => None,
            Some(path) => {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| DecisionLogError {
                        path: path.display().to_string(),
                        source,
                    })?;
                Some((path.to_path_buf(), Mutex::new(f)))
            }
        };
        Ok(Self {
            file,
            kept: Mutex::new(VecDeque::new()),
        })
    }

    /// Records `decision` (a new one, or one again with what was learnt since).
    pub fn record(&self, decision: &Decision) {
        {
            let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
            match kept.iter_mut().find(|d| d.id == decision.id) {
                Some(d) => *d = decision.clone(),
                None => {
                    kept.push_back(decision.clone());
                    if kept.len() > KEPT {
                        kept.pop_front();
                    }
                }
            }
        }
        if let Some((path, file)) = &self.file {
            let mut line = serde_json::to_string(decision).expect("a decision serialises");
            line.push('\n');
            let mut f = file.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(e) = f.write_all(line.as_bytes()).and_then(|()| f.flush()) {
                tracing::warn!(path = %path.display(), error = %e, "cannot write the decision log");
            }
        }
    }

    /// The decisions kept, oldest first.
    pub fn recent(&self) -> Vec<Decision> {
        let kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(id: u64) -> Decision {
        let live = Split {
            prefill: 0,
            decode: 1,
        };
        Decision::new(id, "period", 1.0, live, Observed::default(), 0)
    }

    #[test]
    fn a_decision_is_written_when_made_and_again_when_observed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let log = DecisionLog::open(Some(&path)).unwrap();
        let mut d = decision(1);
        log.record(&d);
        d.observed = Some(Observed {
            ttft_p90_ms: Some(12.0),
            ..Default::default()
        });
        log.record(&d);
        log.record(&decision(2));
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0]["observed"], serde_json::Value::Null);
        assert_eq!(lines[1]["observed"]["ttft_p90_ms"], 12.0);
        let recent = log.recent();
        assert_eq!(recent.iter().map(|d| d.id).collect::<Vec<_>>(), [1, 2]);
        assert!(recent[0].observed.is_some());
        let err = DecisionLog::open(Some(&dir.path().join("missing/d.jsonl"))).unwrap_err();
        assert!(err.to_string().contains("--decisions-out"), "{err}");
    }
}
