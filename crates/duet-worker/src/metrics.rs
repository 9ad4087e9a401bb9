//! A worker's Prometheus families (`role` prefill or decode, `model`, `engine` = the worker
//! id), read at scrape time from what `Stats` reports ([`crate::stats`]): the published snapshot
//! (queue, running batch, KV blocks, preemptions) and the counters, so nothing is counted twice.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use duet_model::model_path::model_name;
use duet_telemetry::MetricsArgs;
use duet_telemetry::metrics::{ENGINE, MODEL, ROLE, Registration};
use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};

use duet_kv::TierStats;

use crate::EngineHandle;
use crate::stats::{Counters, Published, Snapshot};

/// A worker's metrics, exported until this is dropped: registered in the process's registry
/// and, with `--metrics-listen`, served on the worker's own endpoint.
pub struct Exported {
    _registration: Registration,
    /// Dropped: the endpoint stops.
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// Exports the metrics of worker `worker_id` of `role` (`prefill`, `decode`) serving the model
/// at `model`.
pub async fn export(
    engine: &EngineHandle,
    role: &str,
    model: &Path,
    worker_id: &str,
    args: MetricsArgs,
) -> std::io::Result<Exported> {
    let metrics = WorkerMetrics::new(engine, role, &model_name(model), worker_id);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    args.serve(async {
        let _ = stopped.await;
    })
    .await?;
    Ok(Exported {
        _registration: Registration::new(&metrics),
        _stop: stop,
    })
}

/// A family read from the snapshot or the counters at scrape time.
struct Read {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    value: fn(&Snapshot, &Counters) -> f64,
}

const fn gauge(
    name: &'static str,
    help: &'static str,
    value: fn(&Snapshot, &Counters) -> f64,
) -> Read {
    Read {
        name,
        help,
        kind: MetricType::GAUGE,
        value,
    }
}

const fn counter(
    name: &'static str,
    help: &'static str,
    value: fn(&Snapshot, &Counters) -> f64,
) -> Read {
    Read {
        name,
        help,
        kind: MetricType::COUNTER,
        value,
    }
}

fn load(c: &AtomicU64) -> f64 {
    c.load(Ordering::Relaxed) as f64
}

/// vLLM's names where vLLM has the quantity (`num_requests_running`, `prefix_cache_queries`,
/// ...), with the `duet_` prefix.
const READS: &[Read] = &[
    gauge(
        "duet_num_requests_running",
        "Requests in the running batch (at least one step computed).",
        |s, _| s.running as f64,
    ),
    gauge(
        "duet_num_requests_waiting",
        "Requests admitted but not in any step yet.",
        |s, _| s.waiting as f64,
    ),
    gauge(
        "duet_queued_prefill_tokens",
        "Prompt tokens admitted but not computed yet.",
        |_, c| load(&c.queued_tokens),
    ),
    gauge(
        "duet_kv_reservations",
        "KV reservations waiting for their transfer.",
        |s, _| s.reservations as f64,
    ),
    gauge(
        "duet_kv_blocks_used",
        "KV cache blocks held by sequences and reservations.",
        |s, _| s.pool.in_use as f64,
    ),
    gauge(
        "duet_kv_blocks_free",
        "KV cache blocks free (not counting cached blocks that could be evicted).",
        |s, _| s.pool.free as f64,
    ),
    gauge(
        "duet_kv_blocks_cached",
        "KV cache blocks unused but kept for prefix reuse (evictable).",
        |s, _| s.pool.cached as f64,
    ),
    gauge(
        "duet_kv_cache_usage_perc",
        "Fraction of the KV cache's blocks in use (1 = full).",
        |s, _| s.pool.in_use as f64 / s.pool.num_blocks.max(1) as f64,
    ),
    gauge(
        "duet_prefill_tokens_per_second",
        "Measured prefill rate (the median of the latest prompt-heavy steps; 0 until measured): what the router's TTFT estimate divides by.",
        |s, _| s.prefill_tokens_per_s,
    ),
    counter(
        "duet_worker_requests_total",
        "Requests this worker served.",
        |_, c| load(&c.requests_served),
    ),
    counter(
        "duet_prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        |_, c| load(&c.prompt_tokens),
    ),
    counter(
        "duet_prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache.",
        |_, c| load(&c.prefix_hit_tokens),
    ),
    counter(
        "duet_grammar_failures_total",
        "Requests whose grammar failed part way (an llguidance error), ended with finish_reason error.",
        |_, c| load(&c.grammar_failures),
    ),
    counter(
        "duet_num_preemptions_total",
        "Sequences preempted (their KV given up and recomputed later).",
        |s, _| s.preemptions as f64,
    ),
    counter(
        "duet_spec_decode_sequence_steps_total",
        "Steps that sampled tokens, once per sequence per step (tokens per step = 1 + accepted tokens / this).",
        |s, _| s.speculation.steps as f64,
    ),
    counter(
        "duet_spec_decode_num_draft_tokens_total",
        "Tokens drafted by speculative decoding and verified.",
        |s, _| s.speculation.draft_tokens as f64,
    ),
    counter(
        "duet_spec_decode_out_of_vocab_drafts_total",
        "Drafts cut before a token outside the model's vocabulary (a draft model with other logits): never computed.",
        |s, _| s.out_of_vocab_drafts as f64,
    ),
    counter(
        "duet_spec_decode_num_accepted_tokens_total",
        "Drafted tokens accepted: the model sampled them too (acceptance rate = this / drafted).",
        |s, _| s.speculation.accepted_draft_tokens as f64,
    ),
];

/// A family with one metric per tier below the KV pool (label `tier`), read from the snapshot.
struct TierRead {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    value: fn(&TierStats) -> f64,
}

const fn tier_read(
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    value: fn(&TierStats) -> f64,
) -> TierRead {
    TierRead {
        name,
        help,
        kind,
        value,
    }
}

const TIER_READS: &[TierRead] = &[
    tier_read(
        "duet_kv_tier_hits_total",
        "KV blocks brought up from a tier below the pool instead of recomputed.",
        MetricType::COUNTER,
        |t| t.hits as f64,
    ),
    tier_read(
        "duet_kv_tier_loaded_bytes_total",
        "KV bytes brought up from a tier below the pool.",
        MetricType::COUNTER,
        |t| t.bytes_loaded as f64,
    ),
    tier_read(
        "duet_kv_tier_load_seconds_total",
        "Seconds spent bringing KV blocks up from a tier (tier read and device write).",
        MetricType::COUNTER,
        |t| t.load_seconds,
    ),
    tier_read(
        "duet_kv_tier_stored_bytes_total",
        "KV bytes moved down into a tier.",
        MetricType::COUNTER,
        |t| t.bytes_stored as f64,
    ),
    tier_read(
        "duet_kv_tier_cost_model_misses_total",
        "KV blocks found in a tier but recomputed, because the cost model found recomputing faster.",
        MetricType::COUNTER,
        |t| t.cost_model_misses as f64,
    ),
    tier_read(
        "duet_kv_tier_corrupt_blocks_total",
        "KV blocks found unreadable in a tier (corrupt or truncated files): misses, never served.",
        MetricType::COUNTER,
        |t| t.corrupt as f64,
    ),
    tier_read(
        "duet_kv_tier_blocks",
        "KV blocks held in a tier.",
        MetricType::GAUGE,
        |t| t.blocks as f64,
    ),
    tier_read(
        "duet_kv_tier_capacity_blocks",
        "KV blocks a tier can hold.",
        MetricType::GAUGE,
        |t| t.capacity_blocks as f64,
    ),
    tier_read(
        "duet_kv_tier_load_bytes_per_second",
        "The load bandwidth of a tier the cost model has fitted.",
        MetricType::GAUGE,
        |t| t.load_bytes_per_s,
    ),
    tier_read(
        "duet_kv_tier_page_locked",
        "1 where a tier's memory is page-locked (--kv-host-pinned on a GPU: the copy engine reads and writes its slots directly), else 0.",
        MetricType::GAUGE,
        |t| f64::from(u8::from(t.page_locked)),
    ),
    tier_read(
        "duet_kv_tier_lent_blocks_total",
        "KV blocks brought up straight from their slot of page-locked memory (no copy out of the tier first).",
        MetricType::COUNTER,
        |t| t.lent as f64,
    ),
    tier_read(
        "duet_kv_tier_copy_waits_total",
        "KV blocks moving into a page-locked tier that waited for the device's copies in flight to free a slot.",
        MetricType::COUNTER,
        |t| t.copy_waits as f64,
    ),
];

/// One metric of `value` with `labels`, of `kind`.
fn metric(labels: Vec<LabelPair>, kind: MetricType, value: f64) -> proto::Metric {
    let mut metric = proto::Metric::from_label(labels);
    match kind {
        MetricType::GAUGE => {
            let mut g = proto::Gauge::default();
            g.set_value(value);
            metric.set_gauge(g);
        }
        _ => {
            let mut c = proto::Counter::default();
            c.set_value(value);
            metric.set_counter(c);
        }
    }
    metric
}

fn family(name: &str, help: &str, kind: MetricType, metrics: Vec<proto::Metric>) -> MetricFamily {
    let mut family = MetricFamily::default();
    family.set_name(name.into());
    family.set_help(help.into());
    family.set_field_type(kind);
    family.set_metric(metrics);
    family
}

/// A worker's families, registered with [`duet_telemetry::metrics::Registration`].
#[derive(Clone)]
pub struct WorkerMetrics {
    counters: Arc<Counters>,
    published: Arc<Published>,
    labels: Vec<LabelPair>,
    descs: Arc<Vec<Desc>>,
}

impl WorkerMetrics {
    /// The families of the worker `engine` of `role` (`prefill`, `decode`) with id `worker_id`,
    /// serving `model`.
    pub fn new(engine: &EngineHandle, role: &str, model: &str, worker_id: &str) -> Self {
        let (counters, published) = engine.shared();
        Self::from_parts(counters, published, role, model, worker_id)
    }

    fn from_parts(
        counters: Arc<Counters>,
        published: Arc<Published>,
        role: &str,
        model: &str,
        worker_id: &str,
    ) -> Self {
        let const_labels: HashMap<String, String> =
            [(ROLE, role), (MODEL, model), (ENGINE, worker_id)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        let mut labels: Vec<LabelPair> = const_labels
            .iter()
            .map(|(k, v)| {
                let mut l = LabelPair::default();
                l.set_name(k.clone());
                l.set_value(v.clone());
                l
            })
            .collect();
        labels.sort_by(|a, b| a.name().cmp(b.name()));
        let mut descs: Vec<Desc> = READS
            .iter()
            .map(|r| Desc::new(r.name.into(), r.help.into(), vec![], const_labels.clone()))
            .chain(TIER_READS.iter().map(|r| {
                Desc::new(
                    r.name.into(),
                    r.help.into(),
                    vec!["tier".into()],
                    const_labels.clone(),
                )
            }))
            .collect::<Result<_, _>>()
            .expect("valid metric names");
        for family in labelled_collectors(&counters) {
            for d in family.desc() {
                descs.push(
                    Desc::new(
                        d.fq_name.clone(),
                        d.help.clone(),
                        d.variable_labels.clone(),
                        const_labels.clone(),
                    )
                    .expect("valid metric names"),
                );
            }
        }
        Self {
            counters,
            published,
            labels,
            descs: Arc::new(descs),
        }
    }
}

/// The families the counters keep themselves (histograms, per-transport vectors).
fn labelled_collectors(c: &Counters) -> [&dyn Collector; 7] {
    [
        &c.step_tokens,
        &c.step_seconds,
        &c.kv_transfer_bytes,
        &c.kv_transfer_seconds,
        &c.kv_transfer_failures,
        &c.local_prefill_fallbacks,
        &c.kv_peer_pulls,
    ]
}

impl Collector for WorkerMetrics {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let snapshot = self.published.get();
        let mut families: Vec<MetricFamily> = READS
            .iter()
            .map(|r| {
                let value = (r.value)(&snapshot, &self.counters);
                let metric = metric(self.labels.clone(), r.kind, value);
                family(r.name, r.help, r.kind, vec![metric])
            })
            .collect();
        for r in TIER_READS {
            let metrics = snapshot
                .kv_tiers
                .iter()
                .filter_map(|t| {
                    let mut labels = self.labels.clone();
                    let mut tier = LabelPair::default();
                    tier.set_name("tier".into());
                    tier.set_value(t.tier?.name().into());
                    labels.push(tier);
                    labels.sort_by(|a, b| a.name().cmp(b.name()));
                    Some(metric(labels, r.kind, (r.value)(t)))
                })
                .collect();
            families.push(family(r.name, r.help, r.kind, metrics));
        }
        for collector in labelled_collectors(&self.counters) {
            for mut family in collector.collect() {
                for metric in family.mut_metric() {
                    let mut labels = self.labels.clone();
                    labels.extend(metric.take_label());
                    labels.sort_by(|a, b| a.name().cmp(b.name()));
                    metric.set_label(labels);
                }
                families.push(family);
            }
        }
        families
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_engine::engine::Speculation;

    #[test]
    fn every_family_has_a_duet_name_and_unique() {
        let mut names: Vec<&str> = READS.iter().map(|r| r.name).collect();
        names.extend(TIER_READS.iter().map(|r| r.name));
        let counters = Counters::default();
        let owned: Vec<String> = labelled_collectors(&counters)
            .iter()
            .flat_map(|c| c.desc())
            .map(|d| d.fq_name.clone())
            .collect();
        names.extend(owned.iter().map(String::as_str));
        assert!(names.iter().all(|n| n.starts_with("duet_")), "{names:?}");
        let count = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), count);
    }

    fn find<'a>(families: &'a [MetricFamily], name: &str) -> &'a proto::Metric {
        let family = families
            .iter()
            .find(|f| f.name() == name)
            .unwrap_or_else(|| panic!("no {name}"));
        &family.get_metric()[0]
    }

    /// What a scrape shows is what `Stats` shows, labelled with the worker's role, model and id.
    #[test]
    fn a_scrape_reads_the_snapshot_and_counters_with_the_worker_labels() {
        let counters = Arc::new(Counters::default());
        let published = Arc::new(Published::new(Snapshot {
            pool: duet_kv::PoolStats {
                num_blocks: 10,
                in_use: 4,
                cached: 1,
                free: 5,
            },
            waiting: 2,
            running: 3,
            reservations: 1,
            preemptions: 7,
            out_of_vocab_drafts: 3,
            prefill_tokens_per_s: 1500.0,
            speculation: Speculation {
                steps: 40,
                draft_tokens: 30,
                accepted_draft_tokens: 20,
            },
            kv_tiers: vec![duet_kv::TierStats {
                tier: Some(duet_kv::Tier::Disk),
                capacity_blocks: 100,
                blocks: 9,
                hits: 4,
                bytes_loaded: 4096,
                load_seconds: 0.5,
                stored: 12,
                bytes_stored: 12288,
                cost_model_misses: 3,
                corrupt: 1,
                load_bytes_per_s: 8192.0,
                page_locked: true,
                lent: 5,
                copy_waits: 2,
                ..Default::default()
            }],
        }));
        Counters::add(&counters.prompt_tokens, 64);
        Counters::add(&counters.prefix_hit_tokens, 48);
        counters.transferred("grpc", crate::stats::Direction::In, 4096, 0.02);
        counters.transfer_failed("grpc", crate::stats::Direction::In, "DataLoss");
        counters.step_tokens.observe(17.0);
        let m = WorkerMetrics::from_parts(counters.clone(), published, "decode", "tiny", "d-1");
        let families = m.collect();
        assert_eq!(m.desc().len(), families.len());
        let label = |metric: &proto::Metric, name: &str| {
            metric
                .get_label()
                .iter()
                .find(|l| l.name() == name)
                .map(|l| l.value().to_string())
        };
        for f in &families {
            for metric in f.get_metric() {
                assert_eq!(
                    label(metric, "role").as_deref(),
                    Some("decode"),
                    "{}",
                    f.name()
                );
                assert_eq!(label(metric, "model").as_deref(), Some("tiny"));
                assert_eq!(label(metric, "engine").as_deref(), Some("d-1"));
            }
        }
        let gauge = |name| find(&families, name).get_gauge().get_value();
        let counter = |name| find(&families, name).get_counter().get_value();
        assert_eq!(gauge("duet_num_requests_running"), 3.0);
        assert_eq!(gauge("duet_num_requests_waiting"), 2.0);
        assert_eq!(gauge("duet_kv_blocks_used"), 4.0);
        assert_eq!(gauge("duet_kv_blocks_free"), 5.0);
        assert_eq!(gauge("duet_kv_cache_usage_perc"), 0.4);
        assert_eq!(gauge("duet_prefill_tokens_per_second"), 1500.0);
        assert_eq!(counter("duet_prefix_cache_queries_total"), 64.0);
        assert_eq!(counter("duet_prefix_cache_hits_total"), 48.0);
        assert_eq!(counter("duet_num_preemptions_total"), 7.0);
        assert_eq!(counter("duet_spec_decode_sequence_steps_total"), 40.0);
        assert_eq!(counter("duet_spec_decode_num_draft_tokens_total"), 30.0);
        assert_eq!(counter("duet_spec_decode_num_accepted_tokens_total"), 20.0);
        assert_eq!(counter("duet_spec_decode_out_of_vocab_drafts_total"), 3.0);
        let disk = find(&families, "duet_kv_tier_hits_total");
        assert_eq!(disk.get_counter().get_value(), 4.0);
        assert_eq!(label(disk, "tier").as_deref(), Some("disk"));
        assert_eq!(counter("duet_kv_tier_loaded_bytes_total"), 4096.0);
        assert_eq!(counter("duet_kv_tier_load_seconds_total"), 0.5);
        assert_eq!(counter("duet_kv_tier_stored_bytes_total"), 12288.0);
        assert_eq!(counter("duet_kv_tier_cost_model_misses_total"), 3.0);
        assert_eq!(counter("duet_kv_tier_corrupt_blocks_total"), 1.0);
        assert_eq!(gauge("duet_kv_tier_blocks"), 9.0);
        assert_eq!(gauge("duet_kv_tier_capacity_blocks"), 100.0);
        assert_eq!(gauge("duet_kv_tier_load_bytes_per_second"), 8192.0);
        assert_eq!(gauge("duet_kv_tier_page_locked"), 1.0);
        assert_eq!(counter("duet_kv_tier_lent_blocks_total"), 5.0);
        assert_eq!(counter("duet_kv_tier_copy_waits_total"), 2.0);
        let bytes = find(&families, "duet_kv_transfer_bytes_total");
        assert_eq!(bytes.get_counter().get_value(), 4096.0);
        assert_eq!(label(bytes, "transport").as_deref(), Some("grpc"));
        assert_eq!(label(bytes, "direction").as_deref(), Some("in"));
        let failures = find(&families, "duet_kv_transfer_failures_total");
        assert_eq!(label(failures, "reason").as_deref(), Some("DataLoss"));
        let seconds = find(&families, "duet_kv_transfer_seconds");
        assert_eq!(seconds.get_histogram().get_sample_count(), 1);
        let steps = find(&families, "duet_iteration_tokens_total");
        assert_eq!(steps.get_histogram().get_sample_sum(), 17.0);
        // Stats reads the same bytes.
        assert_eq!(counters.transfer_bytes(crate::stats::Direction::In), 4096);
        assert_eq!(counters.transfer_bytes(crate::stats::Direction::Out), 0);
    }
}
