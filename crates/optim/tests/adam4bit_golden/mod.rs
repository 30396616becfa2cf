//! torchao 0.18's 4-bit Adam reference data (`testdata/torchao_adam4bit_golden.safetensors`,
//! made by `scripts/golden/torchao_adam4bit.py`) and the five golden steps of `Adam4bit` on a
//! backend, shared by `golden_adam4bit.rs` (CPU) and `cuda_adam4bit.rs` (GPU).

use std::collections::HashMap;

use headroom_autograd_core::{BackendRef, Tensor};
use headroom_optim::{
    Adam4bit, Adam4bitConfig, Implementation, Optimizer, ParamGroup, Scaling, StepParams,
};
use headroom_testkit::worst::nan_max_f32;
use safetensors::SafeTensors;

/// The golden parameters: `w` [64, 128] (4-bit states) and `b` [37] (f32 states).
pub(crate) const PARAMS: [&str; 2] = ["w", "b"];
pub(crate) const STEPS: usize = 5;

/// Every tensor of the golden file as raw bytes, with its metadata.
pub(crate) struct Golden {
    pub(crate) tensors: HashMap<String, (Vec<usize>, Vec<u8>)>,
    pub(crate) metadata: HashMap<String, String>,
}

impl Golden {
    pub(crate) fn load() -> Golden {
        let bytes = headroom_testkit::golden::testdata("torchao_adam4bit_golden.safetensors");
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let metadata = meta.metadata().clone().unwrap_or_default();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(name, v)| (name, (v.shape().to_vec(), v.data().to_vec())))
            .collect();
        Golden { tensors, metadata }
    }

    pub(crate) fn bytes(&self, name: &str) -> &[u8] {
        &self.tensors.get(name).unwrap_or_else(|| panic!("{name}")).1
    }

    pub(crate) fn shape(&self, name: &str) -> &[usize] {
        &self.tensors[name].0
    }

    pub(crate) fn f32s(&self, name: &str) -> Vec<f32> {
        f32s(self.bytes(name))
    }
}

pub(crate) fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The two golden configurations with the hyperparameters of the file's metadata (checked
/// against it).
pub(crate) fn configs(golden: &Golden) -> [(&'static str, Adam4bitConfig); 2] {
    let adamw = Adam4bitConfig::adamw();
    let adam_l2 = Adam4bitConfig {
        lr: 3e-3,
        betas: (0.8, 0.99),
        eps: 1e-6,
        weight_decay: 0.1,
        ..Adam4bitConfig::adam()
    };
    for (tag, cfg, class) in [
        ("adamw", &adamw, "AdamW4bit"),
        ("adam_l2", &adam_l2, "Adam4bit"),
    ] {
        let meta = &golden.metadata[&format!("eager_{tag}")];
        assert!(meta.contains(&format!("\"{class}\"")), "{tag}: {meta}");
        // The JSON's numbers in order: lr, betas, eps, weight decay.
        let numbers: Vec<f64> = meta
            .split(|c: char| "[]{},:\" ".contains(c))
            .filter_map(|token| token.parse().ok())
            .collect();
        let expected = [cfg.lr, cfg.betas.0, cfg.betas.1, cfg.eps, cfg.weight_decay];
        assert_eq!(numbers, expected, "metadata of {tag}: {meta}");
    }
    [("adamw", adamw), ("adam_l2", adam_l2)]
}

/// What the optimizer holds after one step: each parameter's values and its state tensors'
/// bytes by name.
pub(crate) struct StepRecord {
    pub(crate) params: Vec<Vec<f32>>,
    pub(crate) states: Vec<HashMap<String, Vec<u8>>>,
}

fn bytes_of(t: &Tensor) -> Vec<u8> {
    match t.dtype() {
        headroom_autograd_core::DType::U8 => t.to_vec::<u8>().unwrap(),
        _ => t
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    }
}

/// The golden parameters on `backend`, requiring gradients.
pub(crate) fn golden_params(golden: &Golden, backend: &BackendRef) -> Vec<Tensor> {
    PARAMS
        .iter()
        .map(|p| {
            let name = format!("param.{p}.0");
            let t = Tensor::from_slice(backend, &golden.f32s(&name), golden.shape(&name)).unwrap();
            t.requires_grad_(true).unwrap();
            t
        })
        .collect()
}

/// Five golden steps of `cfg` on `backend`; with `one_by_one`, each step steps the parameters
/// one at a time (`StepParams::Only`, an optimizer-in-backward hook's call) in reverse order.
pub(crate) fn run(
    golden: &Golden,
    cfg: &Adam4bitConfig,
    backend: &BackendRef,
    one_by_one: bool,
) -> Vec<StepRecord> {
    let params = golden_params(golden, backend);
    let group = ParamGroup::new(params.clone(), cfg.clone());
    let mut optimizer = Adam4bit::new(vec![group], Implementation::Fused).unwrap();
    let ids: Vec<_> = params
        .iter()
        .map(|p| optimizer.param_id(p).unwrap())
        .collect();
    let mut records = Vec::new();
    for t in 1..=STEPS {
        for (p, param) in PARAMS.iter().zip(&params) {
            let name = format!("grad.{p}.{t}");
            let grad =
                Tensor::from_slice(backend, &golden.f32s(&name), golden.shape(&name)).unwrap();
            param.set_grad(Some(grad)).unwrap();
        }
        if one_by_one {
            for id in ids.iter().rev() {
                optimizer
                    .step_with(StepParams::Only(&[*id]), Scaling::None)
                    .unwrap();
            }
        } else {
            optimizer.step().unwrap();
        }
        records.push(StepRecord {
            params: params.iter().map(|p| p.to_vec::<f32>().unwrap()).collect(),
            states: (0..PARAMS.len())
                .map(|idx| {
                    optimizer
                        .param_state(0, idx)
                        .into_iter()
                        .map(|(name, t)| (name.to_string(), bytes_of(&t)))
                        .collect()
                })
                .collect(),
        });
    }
    records
}

/// The golden key of state tensor `key` of parameter `p` after step `t` of `prefix`
/// (`eager_adamw`, ...): `w`'s codes and scales, `b`'s f32 states.
pub(crate) fn state_key(prefix: &str, p: &str, key: &str, t: usize) -> String {
    let moment = if key.ends_with('1') {
        "exp_avg"
    } else {
        "exp_avg_sq"
    };
    match (p, &key[..key.len() - 1]) {
        ("w", "state") => format!("{prefix}.w.{moment}.packed.{t}"),
        ("w", _) => format!("{prefix}.w.{moment}.scale.{t}"),
        _ => format!("{prefix}.b.{moment}.{t}"),
    }
}

/// The largest absolute difference between two f32 slices.
pub(crate) fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, nan_max_f32)
}

/// Elements of `width` bytes at which `a` and `b` differ.
pub(crate) fn differing(a: &[u8], b: &[u8], width: usize) -> usize {
    assert_eq!(a.len(), b.len());
    a.chunks_exact(width)
        .zip(b.chunks_exact(width))
        .filter(|(x, y)| x != y)
        .count()
}
