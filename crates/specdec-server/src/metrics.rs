//! `/metrics` in Prometheus' text format: requests by status, tokens, speculation counters with the
//! acceptance per draft position, latency histograms, queue depth and active sequences.

use std::collections::BTreeMap;
use std::fmt::Write;

use specdec_core::Metrics;

/// A cumulative histogram with fixed bucket bounds, in seconds.
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one value.
    pub fn observe(&mut self, v: f64) {
        for (c, &b) in self.counts.iter_mut().zip(self.bounds) {
            if v <= b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(self.bounds) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

const TTFT_BOUNDS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const ITL_BOUNDS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

/// The server's counters.
#[derive(Clone, Debug)]
pub struct ServerMetrics {
    /// Finished HTTP requests to the API, by status code.
    pub requests: BTreeMap<u16, u64>,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub generated_tokens: u64,
    /// Speculation rounds.
    pub rounds: u64,
    /// Drafted tokens.
    pub drafted: u64,
    /// Accepted drafted tokens.
    pub accepted: u64,
    /// Per draft position: rounds that drafted it, and how many accepted it.
    pub positions: Vec<(u64, u64)>,
    /// Rounds whose model draft ended at draft logits that were not finite.
    pub non_finite_rounds: u64,
    /// Engine steps.
    pub steps: u64,
    /// Time from a request's arrival to its first token.
    pub ttft: Histogram,
    /// Time between consecutive tokens of a sequence (tokens of one round arrive together).
    pub itl: Histogram,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        Self {
            requests: BTreeMap::new(),
            prompt_tokens: 0,
            generated_tokens: 0,
            rounds: 0,
            drafted: 0,
            accepted: 0,
            positions: Vec::new(),
            non_finite_rounds: 0,
            steps: 0,
            ttft: Histogram::new(TTFT_BOUNDS),
            itl: Histogram::new(ITL_BOUNDS),
        }
    }
}

impl ServerMetrics {
    /// Adds a finished request's counters.
    pub fn record_output(&mut self, m: &Metrics, generated: usize) {
        self.generated_tokens += generated as u64;
        self.rounds += m.rounds;
        self.drafted += m.drafted;
        self.accepted += m.accepted;
        self.non_finite_rounds += m.non_finite_rounds;
        if self.positions.len() < m.per_position.len() {
            self.positions.resize(m.per_position.len(), (0, 0));
        }
        for (p, s) in self.positions.iter_mut().zip(&m.per_position) {
            p.0 += s.reached;
            p.1 += s.accepted;
        }
    }

    /// The text exposition.
    pub fn render(&self, queued: usize, active: usize) -> String {
        let mut o = String::new();
        let counter = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let _ = writeln!(
            o,
            "# HELP specdec_requests_total Finished API requests by HTTP status.\n\
             # TYPE specdec_requests_total counter"
        );
        for (status, n) in &self.requests {
            let _ = writeln!(o, "specdec_requests_total{{status=\"{status}\"}} {n}");
        }
        counter(
            &mut o,
            "specdec_prompt_tokens_total",
            "Prompt tokens of admitted requests.",
            self.prompt_tokens,
        );
        counter(
            &mut o,
            "specdec_generated_tokens_total",
            "Generated tokens.",
            self.generated_tokens,
        );
        counter(
            &mut o,
            "specdec_rounds_total",
            "Speculation rounds (draft, verify, commit).",
            self.rounds,
        );
        counter(
            &mut o,
            "specdec_drafted_tokens_total",
            "Drafted tokens.",
            self.drafted,
        );
        counter(
            &mut o,
            "specdec_accepted_tokens_total",
            "Drafted tokens the target accepted.",
            self.accepted,
        );
        counter(
            &mut o,
            "specdec_non_finite_draft_rounds_total",
            "Rounds whose model draft ended because the draft model's logits were not finite.",
            self.non_finite_rounds,
        );
        counter(
            &mut o,
            "specdec_engine_steps_total",
            "Engine steps (one batched target call each).",
            self.steps,
        );
        let per_position =
            |o: &mut String, name: &str, kind: &str, help: &str, v: &dyn Fn(u64, u64) -> f64| {
                let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
                for (i, &(reached, accepted)) in self.positions.iter().enumerate() {
                    let _ = writeln!(
                        o,
                        "{name}{{position=\"{}\"}} {}",
                        i + 1,
                        v(reached, accepted)
                    );
                }
            };
        per_position(
            &mut o,
            "specdec_position_reached_total",
            "counter",
            "Rounds that drafted this position (1 = first) with every earlier drafted token accepted.",
            &|r, _| r as f64,
        );
        per_position(
            &mut o,
            "specdec_position_accepted_total",
            "counter",
            "Drafted tokens accepted at this position.",
            &|_, a| a as f64,
        );
        per_position(
            &mut o,
            "specdec_position_acceptance",
            "gauge",
            "Acceptance rate at this draft position.",
            &|r, a| if r > 0 { a as f64 / r as f64 } else { 0.0 },
        );
        self.ttft.render(
            &mut o,
            "specdec_time_to_first_token_seconds",
            "Time from arrival to the first token.",
        );
        self.itl.render(
            &mut o,
            "specdec_inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence.",
        );
        let _ = writeln!(
            o,
            "# HELP specdec_queue_depth Requests waiting for a decoding slot.\n\
             # TYPE specdec_queue_depth gauge\nspecdec_queue_depth {queued}\n\
             # HELP specdec_active_sequences Sequences being decoded.\n\
             # TYPE specdec_active_sequences gauge\nspecdec_active_sequences {active}"
        );
        o
    }
}
