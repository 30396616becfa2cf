//! The tiny Llama and Qwen2 (`LlamaConfig::tiny`, `LlamaConfig::qwen2_tiny`) against Hugging
//! Face transformers' float64 run: logits, loss and the gradient of every parameter, from
//! `testdata/llama_golden.safetensors` (written by `scripts/golden/llama_tiny.py`, provenance in
//! `testdata/README.md`).
//!
//! [`run_llama_golden`] loads the reference weights into a model of any dtype on any backend,
//! checks the parameter names and the rotary frequencies, runs forward, loss and backward on the
//! golden batch, and returns the errors, so nn's CPU tests (float64 and float32) and ops-cuda's
//! GPU test (float32) share one path. Errors are `max |ours - theirs| / max |theirs|` per tensor
//! ([`relative_error`]). It sits on nn and the golden file, and
//! knows nothing about backends beyond [`BackendRef`].

use headroom_autograd_core::{BackendRef, DType, Generator};
use headroom_nn::{load_weights, read_tensor, LlamaConfig, LlamaForCausalLM, Module};
use safetensors::SafeTensors;

use crate::golden::{relative_error, testdata};
use crate::worst::nan_max;
use crate::Result;

/// Which reference model of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaGolden {
    /// `LlamaConfig::tiny()`, under `llama.`.
    LlamaTiny,
    /// `LlamaConfig::qwen2_tiny()` (q/k/v biases), under `qwen2.`.
    Qwen2Tiny,
}

impl LlamaGolden {
    /// The file's prefix.
    pub fn prefix(self) -> &'static str {
        match self {
            LlamaGolden::LlamaTiny => "llama",
            LlamaGolden::Qwen2Tiny => "qwen2",
        }
    }

    /// The model's configuration.
    pub fn config(self) -> LlamaConfig {
        match self {
            LlamaGolden::LlamaTiny => LlamaConfig::tiny(),
            LlamaGolden::Qwen2Tiny => LlamaConfig::qwen2_tiny(),
        }
    }
}

/// The measured errors of one run against the reference.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaGoldenErrors {
    /// Of the logits.
    pub logits: f64,
    /// Of the loss.
    pub loss: f64,
    /// Of the worst parameter gradient, and that parameter's name.
    pub worst_gradient: (f64, String),
}

impl LlamaGoldenErrors {
    /// The largest of the three.
    pub fn worst(&self) -> f64 {
        nan_max(nan_max(self.logits, self.loss), self.worst_gradient.0)
    }
}

/// Runs `which` in `dtype` on `backend` with the reference weights on the golden batch and
/// returns its errors. Panics (a test failure) when the parameter names differ from Hugging
/// Face's, a rotary frequency is more than one float32 ulp off, or a parameter has no gradient.
pub fn run_llama_golden(
    backend: &BackendRef,
    which: LlamaGolden,
    dtype: DType,
) -> Result<LlamaGoldenErrors> {
    let prefix = which.prefix();
    let bytes = testdata("llama_golden.safetensors");
    let file = SafeTensors::deserialize(&bytes).expect("llama_golden.safetensors parses");
    let model = LlamaForCausalLM::new(backend, which.config(), dtype, &Generator::new(0))?;

    let param_prefix = format!("{prefix}.param.");
    let mut theirs: Vec<String> = file
        .names()
        .into_iter()
        .filter_map(|name| name.strip_prefix(&param_prefix).map(str::to_owned))
        .collect();
    theirs.sort();
    let mut ours: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    ours.sort();
    assert_eq!(ours, theirs, "{prefix}: parameter names");
    load_weights(&model, &file, &param_prefix)?;

    let reference = |name: &str| read_tensor(backend, &file, &format!("{prefix}.{name}"));
    let inv_freq = reference("inv_freq")?.to_vec::<f32>()?;
    let our_freq = model.model.rotary_emb.inv_freq();
    assert_eq!(
        our_freq.len(),
        inv_freq.len(),
        "{prefix}: rotary frequencies"
    );
    for (i, (&ours, &theirs)) in our_freq.iter().zip(&inv_freq).enumerate() {
        assert!(
            (ours - theirs).abs() <= f32::EPSILON * theirs.abs(),
            "{prefix}: rotary frequency {i}: {ours:e} vs Hugging Face's {theirs:e}"
        );
    }

    let input_ids = reference("input_ids")?;
    let logits = model.forward(&input_ids)?;
    let loss = model.loss(&logits, &input_ids)?;
    loss.backward()?;
    let reference_loss = reference("loss")?;
    assert_eq!(
        reference_loss.dtype(),
        DType::F32,
        "{prefix}: Hugging Face's loss is float32 (ForCausalLMLoss upcasts the logits)"
    );
    assert_eq!(loss.dtype(), DType::F32, "{prefix}: the loss is float32");

    let logits_err = relative_error(&logits, &reference("logits")?, "logits");
    let loss_err = relative_error(&loss, &reference_loss, "loss");
    let mut worst_gradient = (0.0f64, String::new());
    for (name, param) in model.named_parameters() {
        let grad = param
            .grad()
            .unwrap_or_else(|| panic!("{prefix}: {name} has no gradient"));
        let err = relative_error(&grad, &reference(&format!("grad.{name}"))?, &name);
        if err.is_nan() || err >= worst_gradient.0 {
            worst_gradient = (err, name);
        }
    }
    Ok(LlamaGoldenErrors {
        logits: logits_err,
        loss: loss_err,
        worst_gradient,
    })
}
