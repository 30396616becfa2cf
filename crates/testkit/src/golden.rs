//! PyTorch's golden models: ViT-tiny (torchvision) and GPT-2-tiny (Hugging Face) with their
//! weights, one batch, and the float64 logits, loss and every parameter's gradient
//! (`testdata/models_golden.safetensors`, provenance in `testdata/README.md`).
//!
//! [`forward_backward`] runs a model on the golden batch on any backend and [`check`] holds the
//! result to the reference, so the CPU test (float64) and the CUDA test (float32) share one
//! path and differ only in their backend, dtype and tolerance. Errors are measured per tensor as
//! `max |ours - theirs| / max |theirs|` ([`relative_error`]): an element-wise ratio is
//! meaningless for entries that are zero up to rounding.

use std::path::{Path, PathBuf};

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_nn::{load_weights, read_tensor, Gpt2Config, Module, VitConfig};
use safetensors::SafeTensors;

use crate::case::{Batch, Model, ModelSpec};
use crate::worst::nan_max;
use crate::Result;

/// The two golden models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GoldenModel {
    /// `VitConfig::tiny()`, under `vit.` in the file.
    VitTiny,
    /// `Gpt2Config::tiny()`, under `gpt2.` in the file.
    Gpt2Tiny,
}

/// A golden model after forward, loss and backward on the golden batch.
#[derive(Debug)]
pub struct GoldenRun {
    /// Which model.
    pub which: GoldenModel,
    /// The model, holding the golden weights and their gradients.
    pub model: Model,
    /// Its output.
    pub logits: Tensor,
    /// Its loss.
    pub loss: Tensor,
}

/// The worst relative error of each kind, from [`check`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GoldenErrors {
    /// Of the logits.
    pub logits: f64,
    /// Of the loss.
    pub loss: f64,
    /// Of the worst parameter gradient.
    pub gradients: f64,
}

/// The bytes of `testdata/<name>`: next to this crate's sources where they were built, else the
/// first `testdata/<name>` up from the working directory (a test binary run elsewhere).
pub fn testdata(name: &str) -> Vec<u8> {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata");
    let from_cwd = std::env::current_dir().into_iter().flat_map(|cwd| {
        cwd.ancestors()
            .map(|dir| dir.join("testdata"))
            .collect::<Vec<PathBuf>>()
    });
    std::iter::once(built)
        .chain(from_cwd)
        .find_map(|dir| std::fs::read(dir.join(name)).ok())
        .unwrap_or_else(|| panic!("testdata/{name} not found"))
}

/// The bytes of `testdata/models_golden.safetensors`.
pub fn models_golden() -> Vec<u8> {
    testdata("models_golden.safetensors")
}

impl GoldenModel {
    /// The file's prefix for this model (`vit`, `gpt2`).
    pub fn prefix(self) -> &'static str {
        match self {
            GoldenModel::VitTiny => "vit",
            GoldenModel::Gpt2Tiny => "gpt2",
        }
    }

    /// A fresh model of this configuration on `backend` in `dtype` (initialised from seed 0;
    /// [`forward_backward`] overwrites the weights).
    pub fn build(self, backend: &BackendRef, dtype: DType) -> Result<Model> {
        let spec = match self {
            GoldenModel::VitTiny => ModelSpec::Vit(VitConfig::tiny()),
            GoldenModel::Gpt2Tiny => ModelSpec::Gpt2 {
                config: Gpt2Config::tiny(),
                seq: Gpt2Config::tiny().n_positions,
            },
        };
        spec.build(backend, dtype, 0)
    }
}

/// Loads the golden weights into `model` (built by [`GoldenModel::build`]), then runs forward,
/// loss and backward on the golden batch; images are converted to the model's dtype, token ids
/// stay I64.
pub fn forward_backward(
    backend: &BackendRef,
    golden: &SafeTensors<'_>,
    which: GoldenModel,
    model: Model,
) -> Result<GoldenRun> {
    let prefix = which.prefix();
    load_weights(&model, golden, &format!("{prefix}.param."))?;
    let batch = match which {
        GoldenModel::VitTiny => {
            let dtype = model.parameters()[0].dtype();
            Batch {
                input: read_tensor(backend, golden, "vit.input")?.to_dtype(dtype)?,
                target: read_tensor(backend, golden, "vit.labels")?,
            }
        }
        GoldenModel::Gpt2Tiny => {
            let input_ids = read_tensor(backend, golden, "gpt2.input_ids")?;
            Batch {
                target: input_ids.clone(),
                input: input_ids,
            }
        }
    };
    let logits = model.forward(&batch.input)?;
    let loss = model.loss(&logits, &batch)?;
    loss.backward()?;
    Ok(GoldenRun {
        which,
        model,
        logits,
        loss,
    })
}

/// Holds the logits, the loss and every parameter's gradient of `run` to the golden file within
/// `tolerance` (relative, per tensor), prints the worst errors, and returns them. Panics on the
/// first tensor outside the tolerance, naming it.
pub fn check(golden: &SafeTensors<'_>, run: &GoldenRun, tolerance: f64) -> GoldenErrors {
    let prefix = run.which.prefix();
    let backend = run.logits.backend();
    let reference = |name: &str| read_tensor(backend, golden, &format!("{prefix}.{name}")).unwrap();
    let logits = relative_error(&run.logits, &reference("logits"), "logits");
    let loss = relative_error(&run.loss, &reference("loss"), "loss");
    let mut gradients = 0.0f64;
    for (name, param) in run.model.named_parameters() {
        let grad = param
            .grad()
            .unwrap_or_else(|| panic!("{name} has no gradient"));
        let err = relative_error(&grad, &reference(&format!("grad.{name}")), &name);
        assert!(err <= tolerance, "{prefix} gradient of {name}: {err:e}");
        gradients = nan_max(gradients, err);
    }
    println!(
        "{prefix} on {:?} in {:?}: logits {logits:.2e}, loss {loss:.2e}, worst parameter \
         gradient {gradients:.2e} (relative)",
        run.logits.device(),
        run.logits.dtype()
    );
    assert!(logits <= tolerance, "{prefix} logits: {logits:e}");
    assert!(loss <= tolerance, "{prefix} loss: {loss:e}");
    GoldenErrors {
        logits,
        loss,
        gradients,
    }
}

/// `max |ours - theirs| / max |theirs|`, after checking that the element counts agree (PyTorch's
/// golden loss is stored as `[1]`, ours is a scalar), that ours are finite and that the
/// reference is not all zeros. `what` names the tensor in failures.
pub fn relative_error(ours: &Tensor, theirs: &Tensor, what: &str) -> f64 {
    assert_eq!(
        ours.numel(),
        theirs.numel(),
        "{what}: {:?} vs {:?}",
        ours.shape(),
        theirs.shape()
    );
    let (ours, theirs) = (ours.to_vec_f64().unwrap(), theirs.to_vec_f64().unwrap());
    assert!(
        ours.iter().all(|v| v.is_finite()),
        "{what}: non-finite values"
    );
    let scale = theirs.iter().fold(0.0f64, |acc, v| acc.max(v.abs()));
    let diff = ours
        .iter()
        .zip(&theirs)
        .fold(0.0f64, |acc, (a, b)| nan_max(acc, (a - b).abs()));
    assert!(scale > 0.0, "{what}: reference is all zeros");
    diff / scale
}

/// Runs `loss`'s backward and returns its value and the gradient of each of `params`, in order,
/// as f64 (the comparison of two ways to compute one loss: fused and unfused, packed and padded).
/// A parameter without a gradient is an error.
pub fn backward_and_gradients(loss: &Tensor, params: &[Tensor]) -> Result<(f64, Vec<Vec<f64>>)> {
    loss.backward()?;
    let grads = params
        .iter()
        .map(|p| {
            let grad = p.grad().ok_or("a parameter has no gradient")?;
            Ok(grad.to_vec_f64()?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((loss.item()?, grads))
}
