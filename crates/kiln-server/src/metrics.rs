//! Counters, gauges and latency histograms, shared lock-free between the scheduler thread and
//! the handlers, and their Prometheus text form.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds.
const LATENCY_BUCKETS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0];

#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = LATENCY_BUCKETS.iter().position(|&b| secs <= b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_micros.fetch_add(d.as_micros() as u64, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&self.buckets) {
            cumulative += bucket.load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_micros.load(Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

#[derive(Default)]
pub struct Metrics {
    pub requests_running: AtomicU64,
    pub requests_waiting: AtomicU64,
    pub requests_total: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub generated_tokens_total: AtomicU64,
    /// Blocks held by running sequences.
    pub kv_blocks_used: AtomicU64,
    /// Blocks held only by the prefix cache (free to evict).
    pub kv_blocks_cached: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    /// The same three of the sliding-window layers' pool (0 on a model without one).
    pub kv_window_blocks_used: AtomicU64,
    pub kv_window_blocks_cached: AtomicU64,
    pub kv_window_blocks_total: AtomicU64,
    pub prefix_cache_hit_tokens_total: AtomicU64,
    pub preemptions_total: AtomicU64,
    pub rejected_total: AtomicU64,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
}

impl Metrics {
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}", v.load(Relaxed));
        };
        metric("kiln_requests_running", "gauge", "Requests whose sequences are in the running batch.", &self.requests_running);
        metric("kiln_requests_waiting", "gauge", "Requests queued for KV blocks or a batch slot.", &self.requests_waiting);
        metric("kiln_requests_total", "counter", "Generation requests accepted.", &self.requests_total);
        metric("kiln_requests_rejected_total", "counter", "Generation requests refused because the queue was full.", &self.rejected_total);
        metric("kiln_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", &self.prompt_tokens_total);
        metric("kiln_generated_tokens_total", "counter", "Tokens generated.", &self.generated_tokens_total);
        metric("kiln_kv_blocks_used", "gauge", "KV blocks held by running sequences.", &self.kv_blocks_used);
        metric("kiln_kv_blocks_cached", "gauge", "KV blocks held only by the prefix cache.", &self.kv_blocks_cached);
        metric("kiln_kv_blocks_total", "gauge", "KV blocks in the pool.", &self.kv_blocks_total);
        metric("kiln_kv_window_blocks_used", "gauge", "Sliding-window layers' KV blocks held by running sequences.", &self.kv_window_blocks_used);
        metric("kiln_kv_window_blocks_cached", "gauge", "Sliding-window layers' KV blocks held only by the prefix cache.", &self.kv_window_blocks_cached);
        metric("kiln_kv_window_blocks_total", "gauge", "KV blocks in the sliding-window layers' pool (0: the model has none).", &self.kv_window_blocks_total);
        metric(
            "kiln_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens taken from the prefix cache instead of computed.",
            &self.prefix_cache_hit_tokens_total,
        );
        metric("kiln_preemptions_total", "counter", "Running sequences preempted for KV blocks and recomputed later.", &self.preemptions_total);
        self.time_to_first_token.render(&mut out, "kiln_time_to_first_token_seconds", "From request arrival to its first generated token.");
        self.inter_token_latency.render(&mut out, "kiln_inter_token_latency_seconds", "Between consecutive generated tokens of a request.");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative() {
        let m = Metrics::default();
        m.time_to_first_token.observe(Duration::from_millis(3));
        m.time_to_first_token.observe(Duration::from_millis(60));
        m.time_to_first_token.observe(Duration::from_secs(100));
        m.requests_total.fetch_add(2, Relaxed);
        let text = m.render();
        assert!(text.contains("kiln_requests_total 2\n"), "{text}");
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"), "{text}");
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"0.075\"} 2\n"), "{text}");
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"30\"} 2\n"), "{text}");
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert!(text.contains("kiln_time_to_first_token_seconds_count 3\n"), "{text}");
    }
}
