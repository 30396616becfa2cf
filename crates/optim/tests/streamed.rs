//! `StreamedOptimizer`: a rule's state in pinned host memory between steps, streamed through
//! the GPU. On the CPU backend it steps as the rule's plain optimizer (bitwise, with the same
//! state dict). On a CUDA device (`--include-ignored`) 4-bit AdamW on bf16 and f32 parameters,
//! 8-bit AdamW and f32 Adam, stepped in in-backward buckets (last parameter first) or whole in
//! runs under a small budget, equal the on-device optimizers bit for bit over six steps; the
//! host holds exactly the bytes of the states the on-device optimizer holds; the state dicts are
//! the same bytes, and one loaded into either continues the run alike.

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::Adam4bitConfig;
use headroom_optim::{
    GroupOptimizer, Implementation, Optimizer, ParamGroup, ParamId, Scaling, StepParams,
    StreamedOptimizer, UpdateRule, DEFAULT_STATE_STREAM_BYTES,
};

/// Two quantised parameters (whole blocks of 128, from 4096 elements), two the 4- and 8-bit
/// rules keep in full precision.
const SHAPES: [&[usize]; 4] = [&[300, 512], &[4096], &[37], &[8, 8]];

fn params_of(backend: &BackendRef, dtype: DType) -> Vec<Tensor> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n = shape.iter().product();
            let values = headroom_testkit::inputs::centered_f32(n, 2.0, 100 + i as u64);
            let t = Tensor::from_slice(backend, &values, shape).unwrap();
            t.to_dtype(dtype).unwrap()
        })
        .collect()
}

fn set_grads(backend: &BackendRef, params: &[Tensor], step: u64) {
    for (i, param) in params.iter().enumerate() {
        let grad =
            headroom_testkit::inputs::centered_f32(param.numel(), 0.2, 1000 * step + i as u64);
        let grad = Tensor::from_slice(backend, &grad, param.shape()).unwrap();
        param
            .set_grad(Some(grad.to_dtype(param.dtype()).unwrap()))
            .unwrap();
    }
}

fn bits(params: &[Tensor]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|p| p.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap())
        .map(|v| v.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// A state dict's metadata pairs and its tensors (name, dtype, shape, bytes).
type Contents = (
    Vec<(String, String)>,
    Vec<(String, String, Vec<usize>, Vec<u8>)>,
);

/// A state dict's metadata and tensors (name, dtype, shape, bytes), sorted: its contents whatever
/// order the serialiser wrote them in.
fn contents(bytes: &[u8]) -> Contents {
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let mut metadata: Vec<(String, String)> = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    metadata.sort();
    let tensors = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let mut named: Vec<_> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = format!("{:?}", view.dtype());
            (name, dtype, view.shape().to_vec(), view.data().to_vec())
        })
        .collect();
    named.sort();
    (metadata, named)
}

/// One step: whole, or in buckets of one parameter from the last to the first, as an
/// in-backward hook steps them, then the end of the backward.
fn step(optimizer: &mut dyn Optimizer, bucketed: bool) {
    if bucketed {
        let ids: Vec<ParamId> = optimizer.params().into_iter().map(|(id, _)| id).collect();
        for id in ids.into_iter().rev() {
            optimizer
                .step_with(StepParams::Only(&[id]), Scaling::None)
                .unwrap();
        }
        optimizer.finish_steps().unwrap();
    } else {
        optimizer.step().unwrap();
    }
}

/// `steps` steps of the rule's plain optimizer and of its streamed one (budget `stream_bytes`)
/// from the same parameters and gradients: the parameters equal bitwise after every step, the
/// streamed one's host bytes equal the plain one's state bytes, and the state dicts are the same
/// bytes. Returns both optimizers and their parameters.
fn streamed_equals_plain<R: UpdateRule>(
    backend: &BackendRef,
    dtype: DType,
    config: &R,
    stream_bytes: u64,
    bucketed: bool,
) -> (
    GroupOptimizer<R>,
    StreamedOptimizer<R>,
    Vec<Tensor>,
    Vec<Tensor>,
) {
    let plain_params = params_of(backend, dtype);
    let streamed_params = params_of(backend, dtype);
    let mut plain = GroupOptimizer::new(
        vec![ParamGroup::new(plain_params.clone(), config.clone())],
        Implementation::Fused,
    )
    .unwrap();
    let mut streamed = StreamedOptimizer::new(
        vec![ParamGroup::new(streamed_params.clone(), config.clone())],
        Implementation::Fused,
        stream_bytes,
    )
    .unwrap();
    for k in 1..=6 {
        set_grads(backend, &plain_params, k);
        set_grads(backend, &streamed_params, k);
        step(&mut plain, bucketed);
        step(&mut streamed, bucketed);
        assert_eq!(
            bits(&streamed_params),
            bits(&plain_params),
            "{} {dtype:?}, budget {stream_bytes}, bucketed {bucketed}: step {k}",
            R::NAME
        );
    }
    let state_bytes: u64 = (0..SHAPES.len())
        .flat_map(|idx| plain.param_state(0, idx))
        .map(|(_, t)| (t.numel() * t.dtype().size_in_bytes()) as u64)
        .sum();
    if backend.device() != headroom_autograd_core::Device::Cpu {
        assert_eq!(streamed.host_state_bytes(), state_bytes, "{}", R::NAME);
    }
    assert_eq!(
        contents(&streamed.state_dict().unwrap()),
        contents(&plain.state_dict().unwrap()),
        "{} {dtype:?}: the state dicts",
        R::NAME
    );
    (plain, streamed, plain_params, streamed_params)
}

/// A state dict of the plain optimizer loaded into the streamed one (and the streamed one's into
/// the plain one) continues both runs alike.
fn state_dicts_cross<R: UpdateRule>(backend: &BackendRef, dtype: DType, config: &R) {
    let (mut plain, mut streamed, plain_params, streamed_params) =
        streamed_equals_plain(backend, dtype, config, DEFAULT_STATE_STREAM_BYTES, true);
    let from_plain = plain.state_dict().unwrap();
    let from_streamed = streamed.state_dict().unwrap();
    streamed.load_state_dict(&from_plain).unwrap();
    plain.load_state_dict(&from_streamed).unwrap();
    for k in 7..=8 {
        set_grads(backend, &plain_params, k);
        set_grads(backend, &streamed_params, k);
        step(&mut plain, true);
        step(&mut streamed, true);
        assert_eq!(
            bits(&streamed_params),
            bits(&plain_params),
            "{}: step {k} after the loads",
            R::NAME
        );
    }
}

#[test]
fn on_the_cpu_it_steps_as_the_plain_optimizer() {
    let cpu: BackendRef = CpuBackend::new_ref();
    for bucketed in [false, true] {
        streamed_equals_plain(&cpu, DType::F32, &Adam4bitConfig::adamw(), 0, bucketed);
    }
    state_dicts_cross(&cpu, DType::BF16, &Adam4bitConfig::adamw());
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn streamed_steps_on_cuda_equal_the_on_device_optimizers() {
    use headroom_ops_cuda::CudaBackend;
    use headroom_optim::kernels::{Adam8bitConfig, AdamConfig};
    let Some(cuda) = headroom_testkit::gpu::shared_or_skip(|| CudaBackend::new(0)) else {
        return;
    };
    let cuda: BackendRef = cuda;
    for dtype in [DType::BF16, DType::F32] {
        for (budget, bucketed) in [(DEFAULT_STATE_STREAM_BYTES, true), (0, true), (8192, false)] {
            streamed_equals_plain(&cuda, dtype, &Adam4bitConfig::adamw(), budget, bucketed);
        }
        streamed_equals_plain(&cuda, dtype, &Adam8bitConfig::adamw(), 0, true);
        state_dicts_cross(&cuda, dtype, &Adam4bitConfig::adamw());
    }
    streamed_equals_plain(&cuda, DType::F32, &AdamConfig::adamw(), 1 << 20, true);
    println!(
        "StreamedOptimizer on CUDA: 4-bit AdamW (bf16 and f32; budgets 1 GiB and 0 in buckets, \
         8 KiB whole), 8-bit AdamW and f32 AdamW bitwise over 6 steps; host bytes equal the \
         on-device state; state dicts equal and cross-load"
    );
}

/// A pinned budget too small for a parameter's state: its bucket's step is the pinned pool's
/// typed error, naming the budget, before that parameter moves; the buckets before it stepped.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn a_pinned_budget_too_small_for_a_state_is_a_typed_error_before_anything_moves() {
    use headroom_ops_cuda::{CudaBackend, CudaBackendOptions};
    // The pinned pool serves blocks up to 1 MiB from 2 MiB segments (one holds the three small
    // parameters' states); the [1024, 2048] parameter's 4-bit state is 2,228,224 bytes, more
    // than the whole budget.
    let options = CudaBackendOptions {
        pinned_budget: Some(2 << 20),
        ..CudaBackendOptions::default()
    };
    let Some(backend) = headroom_testkit::gpu::cuda_or_skip(CudaBackend::with_options(0, options))
    else {
        return;
    };
    let backend: BackendRef = backend;
    let mut params = params_of(&backend, DType::BF16);
    let values = headroom_testkit::inputs::centered_f32(1 << 21, 2.0, 7);
    params[0] = Tensor::from_slice(&backend, &values, &[1024, 2048])
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let before = bits(&params);
    let mut streamed = StreamedOptimizer::new(
        vec![ParamGroup::new(params.clone(), Adam4bitConfig::adamw())],
        Implementation::Fused,
        DEFAULT_STATE_STREAM_BYTES,
    )
    .unwrap();
    set_grads(&backend, &params, 1);
    let ids: Vec<ParamId> = streamed.params().into_iter().map(|(id, _)| id).collect();
    for id in ids[1..].iter().rev() {
        streamed
            .step_with(StepParams::Only(&[*id]), Scaling::None)
            .unwrap();
    }
    let err = streamed
        .step_with(StepParams::Only(&[ids[0]]), Scaling::None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("budget"), "{err}");
    let after = bits(&params);
    assert_eq!(after[0], before[0], "the refused parameter moved");
    assert!(
        (1..SHAPES.len()).all(|i| after[i] != before[i]),
        "the others stepped"
    );
    assert_eq!(streamed.host_state_bytes(), 4096 + 256 + 2 * 4 * (37 + 64));
    println!("pinned budget of 2 MiB: {err}");
}
