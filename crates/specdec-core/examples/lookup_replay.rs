//! Replays the lookup drafter offline over a greedy benchmark's outputs: how many tokens per target
//! step it would reach at the calibrated cost curve, and how well its confidence predicted that.
//!
//! Reads the JSON of `specdec bench --json FILE` (its `ar` records carry each prompt's and output's
//! token ids, its calibration the measured `r(m)`) and decodes every output again, in the file's
//! order, with one [`LookupDrafter`] (as the benchmark keeps one per mode): each round drafts from the committed tokens, accepts the drafted
//! tokens that equal the recorded output and costs `r(drafted + 1)` target steps, as greedy
//! verification would. A drafting change can be measured here in seconds before the benchmark
//! measures it in minutes; the figures leave out timing noise and the context's cost.
//!
//! Usage: `cargo run --release -p specdec-core --example lookup_replay -- BENCH.json`; with
//! `REPLAY_VERBOSE=1` a line per prompt, with `REPLAY_ORACLE=1` each round's whole walk cut where
//! the target stops accepting (what a perfect stopping rule over these drafts would reach).

use std::collections::BTreeMap;

use specdec_core::batch::MAX_LOOKUP_LEN;
use specdec_core::{
    CounterRng, Draft, DraftRequest, LookupDrafter, Proposal, RoundCosts, SamplingParams, SeqId,
};

/// What one prompt's replay reached.
#[derive(Default)]
struct Replay {
    tokens: f64,
    steps: f64,
    expected: f64,
    rounds: usize,
    drafted: usize,
    accepted: usize,
}

fn replay(
    drafter: &mut LookupDrafter,
    prompt: &[u32],
    output: &[u32],
    costs: &RoundCosts,
    max_len: usize,
) -> Replay {
    let seq = SeqId(0);
    let sampling = SamplingParams::default();
    let Some((&first, rest)) = output.split_first() else {
        return Replay::default();
    };
    let mut ctx = prompt.to_vec();
    let Ok(()) = drafter.prefill(seq, &ctx);
    ctx.push(first);
    let Ok(()) = drafter.commit(seq, &ctx);
    let mut r = Replay::default();
    let mut pos = 0;
    while pos < rest.len() {
        let req = DraftRequest {
            seq,
            context: &ctx,
            max_len,
            sampling: &sampling,
            rng: CounterRng::new(0),
            min_confidence: 0.0,
            costs: Some(costs),
            stop_tokens: &[],
        };
        let mut p = Proposal::default();
        drafter.propose_one(&req, &mut p);
        if std::env::var_os("REPLAY_ORACLE").is_some() {
            // The whole walk, cut where the target stops accepting (no drafter can know that).
            let free = DraftRequest { costs: None, ..req };
            drafter.propose_one(&free, &mut p);
            let keep = p
                .tokens
                .iter()
                .zip(&rest[pos..])
                .take_while(|(a, b)| a == b)
                .count();
            p.truncate(keep);
        }
        let want = &rest[pos..];
        let accepted = p
            .tokens
            .iter()
            .zip(want)
            .take_while(|(a, b)| a == b)
            .count();
        let emitted = (accepted + 1).min(want.len());
        let (mut reach, mut expected) = (1.0, 1.0);
        for &a in &p.confidence {
            reach *= f64::from(a);
            expected += reach;
        }
        r.expected += expected;
        r.tokens += emitted as f64;
        r.steps += costs.r(p.tokens.len() + 1);
        r.rounds += 1;
        r.drafted += p.tokens.len();
        r.accepted += accepted;
        ctx.extend_from_slice(&want[..emitted]);
        pos += emitted;
        let Ok(()) = drafter.commit(seq, &ctx);
    }
    r
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: lookup_replay BENCH.json")?;
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let r: Vec<f64> = json["calibration"]["r"]
        .as_array()
        .ok_or("the file has no calibration.r")?
        .iter()
        .filter_map(serde_json::Value::as_f64)
        .collect();
    let costs = RoundCosts {
        r,
        ..RoundCosts::default()
    };
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|t| t.as_u64())
                    .map(|t| t as u32)
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut measured: BTreeMap<String, f64> = BTreeMap::new();
    for rec in json["records"].as_array().ok_or("no records")? {
        if rec["mode"] == "ngram" {
            if let (Some(id), Some(s)) = (rec["id"].as_str(), rec["speedup_vs_ar"].as_f64()) {
                measured.insert(id.to_owned(), s);
            }
        }
    }
    let mut by_cat: BTreeMap<String, Vec<(Replay, Option<f64>)>> = BTreeMap::new();
    // One drafter for the whole run, as the benchmark keeps one per mode: earlier outputs are in
    // its history, and its estimates carry over.
    let mut drafter = LookupDrafter::default();
    for rec in json["records"].as_array().ok_or("no records")? {
        if rec["mode"] != "ar" {
            continue;
        }
        let (prompt, output) = (ids(&rec["prompt_tokens"]), ids(&rec["output_tokens"]));
        let cat = rec["category"].as_str().unwrap_or("?").to_owned();
        let id = rec["id"].as_str().unwrap_or("?");
        let got = replay(&mut drafter, &prompt, &output, &costs, MAX_LOOKUP_LEN);
        if std::env::var_os("REPLAY_VERBOSE").is_some() {
            println!(
                "{id:24} rounds {:4} drafted {:4} accepted {:4} expected {:7.1} tokens {:5} speed {:.2}",
                got.rounds, got.drafted, got.accepted, got.expected, got.tokens, got.tokens / got.steps
            );
        }
        by_cat
            .entry(cat)
            .or_default()
            .push((got, measured.get(id).copied()));
    }
    println!("category   prompts  replayed  measured  exp/emit  accept  tokens/round");
    let mut all = Vec::new();
    for (cat, rs) in &by_cat {
        let speed = median(rs.iter().map(|(r, _)| r.tokens / r.steps).collect());
        let meas = median(rs.iter().filter_map(|(_, m)| *m).collect());
        let (e, t, d, a, n) = rs.iter().fold((0.0, 0.0, 0, 0, 0), |s, (r, _)| {
            (
                s.0 + r.expected,
                s.1 + r.tokens,
                s.2 + r.drafted,
                s.3 + r.accepted,
                s.4 + r.rounds,
            )
        });
        println!(
            "{cat:10} {:7} {speed:8.2}x {meas:8.2}x {:8.3} {:6.1}% {:8.2}",
            rs.len(),
            e / t,
            100.0 * a as f64 / d.max(1) as f64,
            t / n as f64
        );
        all.extend(rs.iter().map(|(r, _)| r.tokens / r.steps));
    }
    println!("all        {:7} {:8.2}x", all.len(), median(all.clone()));
    Ok(())
}
