//! Tiny random-weight GGUF models, written by tests themselves (no downloads), with a byte-level
//! tokenizer and a ChatML template. Enabled by the `testing` feature.

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use specdec_core::{CounterRng, Stream};

use crate::config::Arch;
use crate::error::{Error, Result};

/// Special tokens of the tiny tokenizer, after the 256 byte tokens.
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The chat template of tiny models (ChatML).
pub const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The shape and type of a tiny model.
///
/// Not `PartialEq`: candle's metadata [`Value`] (in `extra_keys`) does not implement it.
#[derive(Clone, Debug)]
pub struct TinySpec {
    /// The architecture.
    pub arch: Arch,
    /// The type of every matrix.
    pub dtype: GgmlDType,
    /// Blocks.
    pub n_layer: usize,
    /// Hidden size; a multiple of the type's block size (256 for k-quants).
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Feed-forward size; a multiple of the block size.
    pub n_ff: usize,
    /// Vocabulary (at least 259 for the tokenizer).
    pub vocab: usize,
    /// Trained context.
    pub ctx: usize,
    /// Weight seed.
    pub seed: u64,
    /// Omit `output.weight` (tied to the embedding).
    pub tied: bool,
    /// `attention.key_length` = `attention.value_length`: a head size other than `n_embd / n_head`
    /// (`None`: the default, and the keys are not written).
    pub head_dim: Option<usize>,
    /// A `rope_freqs.weight` tensor (Llama 3.1 per-pair frequency divisors), `[head_dim / 2]`; see
    /// [`llama3_rope_freqs`].
    pub rope_freqs: Option<Vec<f32>>,
    /// `rope.scaling.type` and `rope.scaling.factor`, e.g. `("linear", 2.0)`.
    pub rope_scaling: Option<(String, f32)>,
    /// More metadata, written after the standard keys (a repeated key overrides on reading); names
    /// are complete (`llama.attention.sliding_window`).
    pub extra_keys: Vec<(String, Value)>,
    /// More 1-D f32 tensors, written after the model's own.
    pub extra_tensors: Vec<(String, Vec<f32>)>,
}

/// Llama 3.1's rope frequency factors (what `convert_hf_to_gguf.py` writes into `rope_freqs.weight`):
/// 1 for wavelengths below `original_ctx / high_freq_factor`, `factor` above
/// `original_ctx / low_freq_factor`, a smooth blend between.
pub fn llama3_rope_freqs(
    theta: f32,
    rope_dim: usize,
    factor: f32,
    (low_freq_factor, high_freq_factor): (f32, f32),
    original_ctx: usize,
) -> Vec<f32> {
    let ctx = original_ctx as f64;
    let (low, high) = (f64::from(low_freq_factor), f64::from(high_freq_factor));
    (0..rope_dim / 2)
        .map(|i| {
            let freq = f64::from(theta).powf(-(2.0 * i as f64) / rope_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < ctx / high {
                1.0
            } else if wavelen > ctx / low {
                factor
            } else {
                let smooth = (ctx / wavelen - low) / (high - low);
                (1.0 / ((1.0 - smooth) / f64::from(factor) + smooth)) as f32
            }
        })
        .collect()
}

impl TinySpec {
    /// A small model of `arch` whose matrices are `dtype`.
    pub fn new(arch: Arch, dtype: GgmlDType) -> Self {
        let k_quant = dtype.block_size() == 256;
        Self {
            arch,
            dtype,
            n_layer: 2,
            n_embd: if k_quant { 256 } else { 64 },
            n_head: 4,
            n_head_kv: 2,
            n_ff: if k_quant { 512 } else { 128 },
            vocab: 272,
            ctx: 512,
            seed: 1,
            tied: arch == Arch::Llama,
            head_dim: None,
            rope_freqs: None,
            rope_scaling: None,
            extra_keys: Vec::new(),
            extra_tensors: Vec::new(),
        }
    }

    /// Writes the model to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let name = match self.arch {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        };
        let head_dim = self.head_dim.unwrap_or(self.n_embd / self.n_head);
        let q_dim = self.n_head * head_dim;
        let kv = self.n_head_kv * head_dim;
        let mut meta: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String(name.into())),
            ("general.name".into(), Value::String(format!("tiny-{name}"))),
            (
                format!("{name}.block_count"),
                Value::U32(self.n_layer as u32),
            ),
            (
                format!("{name}.embedding_length"),
                Value::U32(self.n_embd as u32),
            ),
            (
                format!("{name}.feed_forward_length"),
                Value::U32(self.n_ff as u32),
            ),
            (
                format!("{name}.attention.head_count"),
                Value::U32(self.n_head as u32),
            ),
            (
                format!("{name}.attention.head_count_kv"),
                Value::U32(self.n_head_kv as u32),
            ),
            (format!("{name}.rope.freq_base"), Value::F32(10_000.0)),
            (
                format!("{name}.attention.layer_norm_rms_epsilon"),
                Value::F32(1e-6),
            ),
            (
                format!("{name}.context_length"),
                Value::U32(self.ctx as u32),
            ),
        ];
        if let Some(hd) = self.head_dim {
            for k in ["key_length", "value_length"] {
                meta.push((format!("{name}.attention.{k}"), Value::U32(hd as u32)));
            }
        }
        if let Some((kind, factor)) = &self.rope_scaling {
            meta.push((
                format!("{name}.rope.scaling.type"),
                Value::String(kind.clone()),
            ));
            meta.push((format!("{name}.rope.scaling.factor"), Value::F32(*factor)));
        }
        meta.extend(tokenizer_metadata(self.vocab, self.arch));
        meta.extend(self.extra_keys.iter().cloned());
        let mut rng_pos = 0usize;
        let rng = CounterRng::new(self.seed);
        let mut values = |n: usize, scale: f32, center: f32| -> Vec<f32> {
            let v = (0..n)
                .map(|i| {
                    center + scale * (2.0 * rng.uniform(rng_pos + i, Stream::Target) as f32 - 1.0)
                })
                .collect();
            rng_pos += n;
            v
        };
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        let mut push =
            |name: String, data: Vec<f32>, dims: &[usize], dtype: GgmlDType| -> Result<()> {
                let t = Tensor::from_vec(data, dims, &Device::Cpu)?;
                tensors.push((name, QTensor::quantize(&t, dtype)?));
                Ok(())
            };
        let w = 2.0 / (self.n_embd as f32).sqrt();
        push(
            "token_embd.weight".into(),
            values(self.vocab * self.n_embd, 1.0, 0.0),
            &[self.vocab, self.n_embd],
            self.dtype,
        )?;
        for i in 0..self.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            push(
                n("attn_norm.weight"),
                values(self.n_embd, 0.1, 1.0),
                &[self.n_embd],
                GgmlDType::F32,
            )?;
            push(
                n("attn_q.weight"),
                values(q_dim * self.n_embd, w, 0.0),
                &[q_dim, self.n_embd],
                self.dtype,
            )?;
            push(
                n("attn_k.weight"),
                values(kv * self.n_embd, w, 0.0),
                &[kv, self.n_embd],
                self.dtype,
            )?;
            push(
                n("attn_v.weight"),
                values(kv * self.n_embd, w, 0.0),
                &[kv, self.n_embd],
                self.dtype,
            )?;
            if self.arch == Arch::Qwen2 {
                push(
                    n("attn_q.bias"),
                    values(q_dim, 0.1, 0.0),
                    &[q_dim],
                    GgmlDType::F32,
                )?;
                push(
                    n("attn_k.bias"),
                    values(kv, 0.1, 0.0),
                    &[kv],
                    GgmlDType::F32,
                )?;
                push(
                    n("attn_v.bias"),
                    values(kv, 0.1, 0.0),
                    &[kv],
                    GgmlDType::F32,
                )?;
            }
            push(
                n("attn_output.weight"),
                values(self.n_embd * q_dim, w, 0.0),
                &[self.n_embd, q_dim],
                self.dtype,
            )?;
            push(
                n("ffn_norm.weight"),
                values(self.n_embd, 0.1, 1.0),
                &[self.n_embd],
                GgmlDType::F32,
            )?;
            push(
                n("ffn_gate.weight"),
                values(self.n_ff * self.n_embd, w, 0.0),
                &[self.n_ff, self.n_embd],
                self.dtype,
            )?;
            push(
                n("ffn_up.weight"),
                values(self.n_ff * self.n_embd, w, 0.0),
                &[self.n_ff, self.n_embd],
                self.dtype,
            )?;
            let wd = 2.0 / (self.n_ff as f32).sqrt();
            push(
                n("ffn_down.weight"),
                values(self.n_embd * self.n_ff, wd, 0.0),
                &[self.n_embd, self.n_ff],
                self.dtype,
            )?;
        }
        push(
            "output_norm.weight".into(),
            values(self.n_embd, 0.1, 1.0),
            &[self.n_embd],
            GgmlDType::F32,
        )?;
        if !self.tied {
            push(
                "output.weight".into(),
                values(self.vocab * self.n_embd, w * 4.0, 0.0),
                &[self.vocab, self.n_embd],
                self.dtype,
            )?;
        }
        if let Some(f) = &self.rope_freqs {
            push(
                "rope_freqs.weight".into(),
                f.clone(),
                &[f.len()],
                GgmlDType::F32,
            )?;
        }
        for (name, data) in &self.extra_tensors {
            push(name.clone(), data.clone(), &[data.len()], GgmlDType::F32)?;
        }
        let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensor_refs: Vec<(&str, &QTensor)> =
            tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
        let mut file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        gguf_file::write(&mut file, &meta_refs, &tensor_refs)?;
        Ok(())
    }
}

/// GPT-2's byte-to-character map: printable bytes stand for themselves, the rest are shifted past 255.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!'..=b'~').map(u32::from).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable.contains(&b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

/// A byte-level BPE with no merges: 256 byte tokens, the specials, and reserved tokens up to `vocab`.
fn tokenizer_metadata(vocab: usize, arch: Arch) -> Vec<(String, Value)> {
    let mut tokens: Vec<Value> = byte_chars()
        .into_iter()
        .map(|c| Value::String(c.to_string()))
        .collect();
    let mut types: Vec<Value> = vec![Value::I32(1); 256];
    for s in SPECIALS {
        tokens.push(Value::String(s.into()));
        types.push(Value::I32(3));
    }
    let mut i = 0;
    while tokens.len() < vocab {
        tokens.push(Value::String(format!("<|reserved_{i}|>")));
        types.push(Value::I32(3));
        i += 1;
    }
    let pre = match arch {
        Arch::Qwen2 => "qwen2",
        Arch::Llama => "smollm",
    };
    vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(258)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(256)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        (
            "tokenizer.chat_template".into(),
            Value::String(CHATML.into()),
        ),
    ]
}

/// The environment variable that turns a missing real model from a skip into a test failure (CI sets
/// it to `1`).
pub const REQUIRE_MODELS: &str = "SPECDEC_REQUIRE_MODELS";

/// A test that needs real models from the cache, for a `harness = false` test binary run by
/// [`run_trials`]. When a model is missing the test is reported as `ignored, needs the real models:
/// run specdec fetch` in `cargo test`'s own output, or fails when [`REQUIRE_MODELS`] is `1`.
pub fn real_trial<F>(name: &str, aliases: &'static [&'static str], test: F) -> libtest_mimic::Trial
where
    F: FnOnce(Vec<std::path::PathBuf>) + Send + 'static,
{
    use libtest_mimic::{Completion, Failed};
    libtest_mimic::Trial::ignorable_test(name, move || {
        let mut paths = Vec::new();
        let mut missing = Vec::new();
        for alias in aliases {
            match crate::fetch::known(alias) {
                Some(m) if m.is_present() => paths.push(m.path()),
                Some(_) => missing.push(*alias),
                None => return Err(Failed::from(format!("unknown model alias {alias}"))),
            }
        }
        if missing.is_empty() {
            test(paths);
            return Ok(Completion::Completed);
        }
        let why = format!(
            "needs the real models: {} not in {} (run `specdec fetch`)",
            missing.join(", "),
            crate::fetch::models_dir().display()
        );
        if std::env::var(REQUIRE_MODELS).is_ok_and(|v| v == "1") {
            Err(Failed::from(format!(
                "{why}; {REQUIRE_MODELS}=1 makes this a failure"
            )))
        } else {
            Ok(Completion::ignored_with(why))
        }
    })
}

/// Runs `trials` with libtest's command-line arguments and exits with its status: the `main` of a
/// `harness = false` test binary.
pub fn run_trials(trials: Vec<libtest_mimic::Trial>) -> ! {
    libtest_mimic::run(&libtest_mimic::Arguments::from_args(), trials).exit()
}
