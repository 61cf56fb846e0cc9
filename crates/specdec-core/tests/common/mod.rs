//! Shared helpers: the chi-square goodness-of-fit test and mock set-ups.
#![allow(dead_code)]

use specdec_core::mock::MockLogits;
use specdec_core::{Probs, Sampler, SamplingParams, TokenId};

/// ln Γ(x) for x > 0 (Lanczos, g = 7, n = 9; relative error below 1e-13).
pub fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        return std::f64::consts::PI.ln()
            - (std::f64::consts::PI * x).sin().ln()
            - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = G[0];
    let t = x + 7.5;
    for (i, g) in G.iter().enumerate().skip(1) {
        a += g / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// The regularised upper incomplete gamma function Q(a, x) (Numerical Recipes 6.2).
pub fn gamma_q(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let gln = ln_gamma(a);
    if x < a + 1.0 {
        // Series for P.
        let mut ap = a;
        let mut sum = 1.0 / a;
        let mut del = sum;
        for _ in 0..10_000 {
            ap += 1.0;
            del *= x / ap;
            sum += del;
            if del.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        1.0 - sum * (-x + a * x.ln() - gln).exp()
    } else {
        // Continued fraction for Q (modified Lentz).
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let del = d * c;
            h *= del;
            if (del - 1.0).abs() < 1e-15 {
                break;
            }
        }
        (-x + a * x.ln() - gln).exp() * h
    }
}

/// Pearson's chi-square test of observed counts against expected probabilities. Cells expected to
/// hold fewer than 5 counts are pooled into one. Returns (statistic, degrees of freedom, p-value).
/// Observations in a cell of zero probability make the p-value 0.
pub fn chi_square(observed: &[u64], expected: &[f64]) -> (f64, usize, f64) {
    assert_eq!(observed.len(), expected.len());
    let n: u64 = observed.iter().sum();
    let n = n as f64;
    let mut stat = 0.0;
    let mut cells = 0usize;
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (&o, &p) in observed.iter().zip(expected) {
        let e = p * n;
        if p <= 0.0 {
            if o > 0 {
                return (f64::INFINITY, 0, 0.0);
            }
            continue;
        }
        if e < 5.0 {
            pool_o += o as f64;
            pool_e += e;
            continue;
        }
        stat += (o as f64 - e).powi(2) / e;
        cells += 1;
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e;
        cells += 1;
    }
    let df = cells.saturating_sub(1).max(1);
    (stat, df, gamma_q(df as f64 / 2.0, stat / 2.0))
}

/// The target distribution of the token after `context`, formed exactly as the decoder forms it.
pub fn target_probs(logits: &MockLogits, params: &SamplingParams, context: &[TokenId]) -> Vec<f64> {
    let mut s = Sampler::new(params.clone());
    let mut out = Probs::OneHot(0);
    s.probs(&logits.logits(context), context, &mut out).unwrap();
    let vocab = logits.vocab();
    (0..vocab as TokenId)
        .map(|t| f64::from(out.prob(t)))
        .collect()
}

/// A pseudo-random prompt.
pub fn prompt(seed: u64, len: usize, vocab: usize) -> Vec<TokenId> {
    let rng = specdec_core::CounterRng::new(seed);
    (0..len)
        .map(|i| (rng.uniform(i, specdec_core::Stream::Target) * vocab as f64) as TokenId)
        .collect()
}

#[test]
fn chi_square_p_values_match_tables() {
    // Upper 5% points of the chi-square distribution.
    assert!((gamma_q(0.5, 3.841 / 2.0) - 0.05).abs() < 1e-3);
    assert!((gamma_q(5.0, 18.307 / 2.0) - 0.05).abs() < 1e-3);
    assert!((gamma_q(50.0, 124.342 / 2.0) - 0.05).abs() < 1e-3);
}

/// A hybrid that extends every lookup draft with the model, whatever a cost model would choose: the
/// lookup draft is cut to half the draft length and the model drafts the rest after it; a round
/// without a lookup draft is a model draft. It exercises [`specdec_core::draft_planned`]'s
/// extension in every round where the lookup finds something.
pub struct ExtendingHybrid<D> {
    /// The lookup drafter.
    pub lookup: specdec_core::LookupDrafter,
    /// The model drafter.
    pub model: D,
    lag: specdec_core::ModelLag,
}

impl<D> ExtendingHybrid<D> {
    /// The learning lookup and `model`.
    pub fn new(model: D) -> Self {
        Self {
            lookup: specdec_core::LookupDrafter::default(),
            model,
            lag: specdec_core::ModelLag::default(),
        }
    }
}

impl<D: specdec_core::Draft> specdec_core::Draft for ExtendingHybrid<D> {
    type Error = D::Error;

    fn vocab_size(&self) -> Option<usize> {
        self.model.vocab_size()
    }

    fn propose(
        &mut self,
        batch: &[specdec_core::DraftRequest<'_>],
        out: &mut [specdec_core::Proposal],
    ) -> Result<(), Self::Error> {
        use specdec_core::HybridPlan;
        let plans: Vec<HybridPlan> = batch
            .iter()
            .zip(out.iter_mut())
            .map(|(req, out)| {
                self.lookup.propose_one(req, out);
                out.truncate(req.max_len / 2);
                let room = req.max_len - out.tokens.len();
                if out.tokens.is_empty() {
                    HybridPlan::Model
                } else if room > 0 {
                    HybridPlan::Extend(room)
                } else {
                    HybridPlan::Lookup
                }
            })
            .collect();
        specdec_core::draft_planned(&mut self.model, &mut self.lag, batch, out, &plans)
    }

    fn commit(
        &mut self,
        seq: specdec_core::SeqId,
        committed: &[TokenId],
    ) -> Result<(), Self::Error> {
        let Ok(()) = self.lookup.commit(seq, committed);
        self.model.commit(seq, committed)
    }

    fn prefill(
        &mut self,
        seq: specdec_core::SeqId,
        context: &[TokenId],
    ) -> Result<(), Self::Error> {
        let Ok(()) = self.lookup.prefill(seq, context);
        self.lag.prefill(seq, context.len());
        self.model.prefill(seq, context)
    }

    fn release(&mut self, seq: specdec_core::SeqId) {
        self.lookup.release(seq);
        self.lag.release(seq);
        self.model.release(seq);
    }
}

/// What a test does around a wrapped drafter's calls ([`Watched`]); each default forwards the
/// call unchanged, so a test overrides only the calls it watches or changes.
pub trait Hooks<D: specdec_core::Draft> {
    /// Around [`specdec_core::Draft::propose`].
    fn propose(
        &mut self,
        inner: &mut D,
        batch: &[specdec_core::DraftRequest<'_>],
        out: &mut [specdec_core::Proposal],
    ) -> Result<(), D::Error> {
        inner.propose(batch, out)
    }

    /// Around [`specdec_core::Draft::prefill`].
    fn prefill(
        &mut self,
        inner: &mut D,
        seq: specdec_core::SeqId,
        context: &[TokenId],
    ) -> Result<(), D::Error> {
        inner.prefill(seq, context)
    }

    /// Around [`specdec_core::Draft::prefill_priced`].
    fn prefill_priced(
        &mut self,
        inner: &mut D,
        req: &specdec_core::PrefillRequest<'_>,
    ) -> Result<(), D::Error> {
        inner.prefill_priced(req)
    }
}

/// A drafter that forwards every call of [`specdec_core::Draft`] to `inner`, through `hooks`
/// where they watch or change it: wrapping a drafter keeps all of its behaviour (its pricing of
/// prompt reads, what it holds, its truncations) but what the test changes.
#[derive(Debug)]
pub struct Watched<D, H> {
    /// The drafter.
    pub inner: D,
    /// What the test does around its calls.
    pub hooks: H,
}

impl<D, H> Watched<D, H> {
    /// `inner` watched by `hooks`.
    pub fn new(inner: D, hooks: H) -> Self {
        Self { inner, hooks }
    }
}

impl<D: specdec_core::Draft, H: Hooks<D>> specdec_core::Draft for Watched<D, H> {
    type Error = D::Error;

    fn vocab_size(&self) -> Option<usize> {
        self.inner.vocab_size()
    }

    fn propose(
        &mut self,
        batch: &[specdec_core::DraftRequest<'_>],
        out: &mut [specdec_core::Proposal],
    ) -> Result<(), Self::Error> {
        self.hooks.propose(&mut self.inner, batch, out)
    }

    fn commit(
        &mut self,
        seq: specdec_core::SeqId,
        committed: &[TokenId],
    ) -> Result<(), Self::Error> {
        self.inner.commit(seq, committed)
    }

    fn truncated(&mut self, seq: specdec_core::SeqId, len: usize) {
        self.inner.truncated(seq, len);
    }

    fn prefill(
        &mut self,
        seq: specdec_core::SeqId,
        context: &[TokenId],
    ) -> Result<(), Self::Error> {
        self.hooks.prefill(&mut self.inner, seq, context)
    }

    fn prefill_priced(
        &mut self,
        req: &specdec_core::PrefillRequest<'_>,
    ) -> Result<(), Self::Error> {
        self.hooks.prefill_priced(&mut self.inner, req)
    }

    fn cached(&self, seq: specdec_core::SeqId, context: &[TokenId]) -> usize {
        self.inner.cached(seq, context)
    }

    fn model_drafts(&self, seq: specdec_core::SeqId) -> bool {
        self.inner.model_drafts(seq)
    }

    fn release(&mut self, seq: specdec_core::SeqId) {
        self.inner.release(seq);
    }
}
