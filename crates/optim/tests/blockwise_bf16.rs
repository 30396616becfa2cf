//! 8-bit and 4-bit Adam on bf16 parameters without an f32 master copy (torchao's
//! `bf16_stochastic_round`, bitsandbytes' bf16 parameters): one step on bf16 parameters is the
//! step on their f32 values stored by the config's rounding, to the bit, with the same states
//! (a large parameter too, stepped in runs on rayon's pool, whose bits equal its slices'
//! one by one);
//! stochastic rounding keeps the updates that rounding to nearest loses; a state dict continues a
//! run; and (`--include-ignored`, on a CUDA device) CUDA steps equal the CPU's bit for bit, both
//! roundings, quantised and f32 states. Built with the `cuda` feature (as CI's `--all-features`
//! builds it) for the shared tensor helpers; the CPU tests need no device.
#![cfg(feature = "cuda")]

mod cuda_tensors;

use cuda_tensors::{random, raw_bytes, tensor_of};
use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::{
    adam4bit_blockwise, adam8bit_blockwise, bf16, dynamic_map, Bf16Rounding, BlockwiseBuffers,
    GradScaling, ParamRounding,
};
use headroom_optim::{
    Adam4bitConfig, Adam8bitConfig, GroupOptimizer, Implementation, Optimizer, ParamGroup,
    UpdateRule,
};

/// Shapes with quantised states under both rules ([8192]; [640, 128] in runs on rayon's pool,
/// whose rounding indices continue across runs); 8-bit codes with a partial last block but f32
/// states under the 4-bit rule (not whole blocks of 128); f32 states under both.
const SHAPES: [&[usize]; 4] = [&[8192], &[640, 128], &[300, 20], &[37]];

/// A block-wise rule's config: AdamW's defaults (Adam's with `adam`) with `lr` and `rounding`.
trait Blockwise: UpdateRule + Clone {
    fn with(lr: f64, rounding: Bf16Rounding, adam: bool) -> Self;
}

impl Blockwise for Adam8bitConfig {
    fn with(lr: f64, bf16_rounding: Bf16Rounding, adam: bool) -> Self {
        let base = if adam {
            Adam8bitConfig::adam()
        } else {
            Adam8bitConfig::adamw()
        };
        Adam8bitConfig {
            lr,
            bf16_rounding,
            ..base
        }
    }
}

impl Blockwise for Adam4bitConfig {
    fn with(lr: f64, bf16_rounding: Bf16Rounding, adam: bool) -> Self {
        let base = if adam {
            Adam4bitConfig::adam()
        } else {
            Adam4bitConfig::adamw()
        };
        Adam4bitConfig {
            lr,
            bf16_rounding,
            ..base
        }
    }
}

const ROUNDINGS: [Bf16Rounding; 2] = [
    Bf16Rounding::Nearest,
    Bf16Rounding::Stochastic { seed: 0x5eed },
];

/// AdamW of rule `R` (fused) over `params`.
fn optimizer<R: Blockwise>(
    params: &[Tensor],
    lr: f64,
    rounding: Bf16Rounding,
) -> GroupOptimizer<R> {
    let groups = vec![ParamGroup::new(
        params.to_vec(),
        R::with(lr, rounding, false),
    )];
    GroupOptimizer::new(groups, Implementation::Fused).unwrap()
}

/// Random parameters of `SHAPES` as tensors of `dtype` on `backend` (bf16 values, widened
/// exactly for f32).
fn params_of(backend: &BackendRef, dtype: DType) -> Vec<Tensor> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n = shape.iter().product();
            let values: Vec<f32> = random(i as u64 + 11, n, 2.0)
                .into_iter()
                .map(|v| bf16::from_f32(v).to_f32())
                .collect();
            tensor_of(backend, &values, shape, dtype)
        })
        .collect()
}

/// Sets step `step`'s gradients (bf16 values) on `params`.
fn set_grads(backend: &BackendRef, params: &[Tensor], step: u64) {
    for (i, p) in params.iter().enumerate() {
        let values: Vec<f32> = random(100 * step + i as u64, p.numel(), 0.02)
            .into_iter()
            .map(|v| bf16::from_f32(v).to_f32())
            .collect();
        p.set_grad(Some(tensor_of(backend, &values, p.shape(), p.dtype())))
            .unwrap();
    }
}

/// Every state tensor of every parameter as (parameter, name, bytes), sorted.
fn states<R: UpdateRule>(
    optimizer: &GroupOptimizer<R>,
    n_params: usize,
) -> Vec<(usize, String, Vec<u8>)> {
    let mut all: Vec<_> = (0..n_params)
        .flat_map(|idx| {
            optimizer
                .param_state(0, idx)
                .into_iter()
                .map(move |(name, t)| (idx, name.to_string(), raw_bytes(&t)))
        })
        .collect();
    all.sort();
    all
}

#[test]
fn one_bf16_step_is_the_f32_step_stored_by_its_rounding() {
    one_step::<Adam8bitConfig>();
    one_step::<Adam4bitConfig>();
}

fn one_step<R: Blockwise>() {
    let cpu = CpuBackend::new_ref();
    let rule = R::NAME;
    {
        for rounding in ROUNDINGS {
            let (half, full) = (params_of(&cpu, DType::BF16), params_of(&cpu, DType::F32));
            let initial = params_of(&cpu, DType::BF16);
            let mut on_half = optimizer::<R>(&half, 1e-2, rounding);
            let mut on_full = optimizer::<R>(&full, 1e-2, rounding);
            set_grads(&cpu, &half, 1);
            set_grads(&cpu, &full, 1);
            on_half.step().unwrap();
            on_full.step().unwrap();
            let store = ParamRounding::of(rounding, 0, 1);
            for (slot, (h, f)) in half.iter().zip(&full).enumerate() {
                let store = ParamRounding::of(rounding, slot, 1);
                let expected: Vec<u16> = f
                    .to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| store.store::<bf16>(v, i).to_bits())
                    .collect();
                let got: Vec<u16> = h
                    .to_vec::<bf16>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                let off = got.iter().zip(&expected).filter(|(a, b)| a != b).count();
                assert_eq!(off, 0, "{rule} {rounding:?} parameter {slot}: {off} differ");
                let moved = raw_bytes(h) != raw_bytes(&initial[slot]);
                assert!(moved, "{rule} {rounding:?} parameter {slot} did not move");
            }
            assert_eq!(store.key().is_some(), rounding != Bf16Rounding::Nearest);
            assert!(
                states(&on_half, SHAPES.len()) == states(&on_full, SHAPES.len()),
                "{rule} {rounding:?}: the states differ from the f32 step's"
            );
            let quantized = on_half
                .param_state(0, 0)
                .iter()
                .filter(|(_, t)| t.dtype() == DType::U8)
                .count();
            assert_eq!(quantized, 2, "{rule}: codes for the large parameter");
            for (idx, _) in SHAPES.iter().enumerate() {
                for (name, t) in on_half.param_state(0, idx) {
                    assert_ne!(t.dtype(), DType::BF16, "{rule} {idx} {name}: never bf16");
                }
            }
        }
    }
}

/// All ones, a constant gradient and lr 1e-3: each step moves a parameter by about 1e-3, under
/// half a bf16 ulp at 1 (2^-8). To nearest nothing moves; stochastically the mean after ten steps
/// is the f32 run's, within 5e-4 (seven standard deviations of the rounding noise's mean).
/// The raw kernels on a parameter of 106_496 elements (four runs on rayon's pool, the last one
/// short) equal the same kernels called on its slices of 8192 (each on the calling thread), to the
/// bit: parameters, codes and scales.
#[test]
fn a_large_parameter_in_parallel_runs_equals_its_slices_one_by_one() {
    let n = 3 * 32768 + 8192;
    let param = random(1, n, 2.0);
    let grad = random(2, n, 0.02);
    for codes_per_byte in [1, 2] {
        let block = if codes_per_byte == 1 { 256 } else { 128 };
        let step = |p: &mut [f32],
                    g: &[f32],
                    c1: &mut [u8],
                    c2: &mut [u8],
                    a1: &mut [f32],
                    a2: &mut [f32]| {
            let bufs = BlockwiseBuffers {
                param: p,
                grad: g,
                state1: c1,
                state2: c2,
                absmax1: a1,
                absmax2: a2,
            };
            if codes_per_byte == 1 {
                let (q1, q2) = (dynamic_map(true), dynamic_map(false));
                let cfg = Adam8bitConfig::adamw();
                adam8bit_blockwise(
                    &cfg,
                    1,
                    &q1,
                    &q2,
                    bufs,
                    GradScaling::NONE,
                    ParamRounding::NEAREST,
                )
            } else {
                adam4bit_blockwise(
                    &Adam4bitConfig::adamw(),
                    1,
                    bufs,
                    GradScaling::NONE,
                    ParamRounding::NEAREST,
                )
            }
            .unwrap();
        };
        let fresh = || {
            (
                param.clone(),
                vec![0u8; n / codes_per_byte],
                vec![0u8; n / codes_per_byte],
                vec![0f32; n / block],
                vec![0f32; n / block],
            )
        };
        let (mut p, mut c1, mut c2, mut a1, mut a2) = fresh();
        step(&mut p, &grad, &mut c1, &mut c2, &mut a1, &mut a2);
        let (mut q, mut d1, mut d2, mut b1, mut b2) = fresh();
        let slice = 8192;
        for k in 0..n / slice {
            let (e, c, a) = (k * slice, k * slice / codes_per_byte, k * slice / block);
            let (ec, cc, ac) = (e + slice, c + slice / codes_per_byte, a + slice / block);
            step(
                &mut q[e..ec],
                &grad[e..ec],
                &mut d1[c..cc],
                &mut d2[c..cc],
                &mut b1[a..ac],
                &mut b2[a..ac],
            );
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&p),
            bits(&q),
            "{codes_per_byte} codes a byte: parameters"
        );
        assert!(c1 == d1 && c2 == d2, "{codes_per_byte} codes a byte: codes");
        assert_eq!(
            bits(&a1),
            bits(&b1),
            "{codes_per_byte} codes a byte: scales"
        );
        assert_eq!(
            bits(&a2),
            bits(&b2),
            "{codes_per_byte} codes a byte: scales"
        );
    }
}

#[test]
fn stochastic_rounding_keeps_the_updates_rounding_to_nearest_loses() {
    small_updates::<Adam8bitConfig>();
    small_updates::<Adam4bitConfig>();
}

fn small_updates<R: Blockwise>() {
    let cpu = CpuBackend::new_ref();
    let (n, rule) = (8192, R::NAME);
    let mut means = Vec::new();
    for (dtype, rounding) in [
        (DType::F32, Bf16Rounding::Nearest),
        (DType::BF16, Bf16Rounding::Nearest),
        (DType::BF16, ROUNDINGS[1]),
    ] {
        let param = tensor_of(&cpu, &vec![1.0; n], &[n], dtype);
        let groups = vec![ParamGroup::new(
            vec![param.clone()],
            R::with(1e-3, rounding, true),
        )];
        let mut optimizer = GroupOptimizer::<R>::new(groups, Implementation::Fused).unwrap();
        for _ in 0..10 {
            let grad = tensor_of(&cpu, &vec![0.5; n], &[n], dtype);
            param.set_grad(Some(grad)).unwrap();
            optimizer.step().unwrap();
        }
        let values: Vec<f32> = match dtype {
            DType::BF16 => param
                .to_vec::<bf16>()
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect(),
            _ => param.to_vec::<f32>().unwrap(),
        };
        if rounding == Bf16Rounding::Nearest && dtype == DType::BF16 {
            assert!(values.iter().all(|&v| v == 1.0), "{rule}: to nearest moved");
        }
        means.push(values.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64);
    }
    let (full, stochastic) = (means[0], means[2]);
    println!("{rule}: f32 mean {full:.6}, bf16 stochastic {stochastic:.6}, to nearest 1");
    assert!((full - 0.99).abs() < 1e-4, "{rule}: f32 run's mean {full}");
    assert!(
        (stochastic - full).abs() < 5e-4,
        "{rule}: {stochastic} against {full}"
    );
}

/// Two steps, a state dict, a fresh optimizer on the parameters' values loading it, two more
/// steps: the same bits as four steps in one run (the rounding's stream follows the step count).
#[test]
fn a_bf16_state_dict_continues_a_run() {
    continues::<Adam8bitConfig>();
    continues::<Adam4bitConfig>();
}

fn continues<R: Blockwise>() {
    let cpu = CpuBackend::new_ref();
    let rule = R::NAME;
    {
        let rounding = ROUNDINGS[1];
        let straight = params_of(&cpu, DType::BF16);
        let mut one_run = optimizer::<R>(&straight, 1e-2, rounding);
        for step in 1..=4 {
            set_grads(&cpu, &straight, step);
            one_run.step().unwrap();
        }
        let first = params_of(&cpu, DType::BF16);
        let mut before = optimizer::<R>(&first, 1e-2, rounding);
        for step in 1..=2 {
            set_grads(&cpu, &first, step);
            before.step().unwrap();
        }
        let saved = before.state_dict().unwrap();
        let resumed: Vec<Tensor> = first
            .iter()
            .map(|p| Tensor::from_slice(&cpu, &p.to_vec::<bf16>().unwrap(), p.shape()).unwrap())
            .collect();
        let mut after = optimizer::<R>(&resumed, 1e-2, rounding);
        after.load_state_dict(&saved).unwrap();
        for step in 3..=4 {
            set_grads(&cpu, &resumed, step);
            after.step().unwrap();
        }
        for (a, b) in resumed.iter().zip(&straight) {
            assert_eq!(raw_bytes(a), raw_bytes(b), "{rule}");
        }
    }
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn bf16_steps_on_cuda_equal_the_cpu() {
    on_cuda::<Adam8bitConfig>();
    on_cuda::<Adam4bitConfig>();
}

#[cfg(feature = "cuda")]
fn on_cuda<R: Blockwise>() {
    let Some((cuda, cpu)) = cuda_tensors::shared_cuda_and_cpu() else {
        return;
    };
    let rule = R::NAME;
    {
        for rounding in ROUNDINGS {
            let mut runs = Vec::new();
            for backend in [&cpu, &cuda] {
                let params = params_of(backend, DType::BF16);
                let mut optimizer = optimizer::<R>(&params, 1e-2, rounding);
                for step in 1..=3 {
                    set_grads(backend, &params, step);
                    optimizer.step().unwrap();
                }
                let values: Vec<Vec<u8>> = params.iter().map(raw_bytes).collect();
                runs.push((values, states(&optimizer, SHAPES.len())));
            }
            let (host, device) = (&runs[0], &runs[1]);
            for (idx, (h, d)) in host.0.iter().zip(&device.0).enumerate() {
                let off = h.chunks(2).zip(d.chunks(2)).filter(|(a, b)| a != b).count();
                assert_eq!(off, 0, "{rule} {rounding:?} parameter {idx}: {off} differ");
            }
            assert!(host.1 == device.1, "{rule} {rounding:?}: states differ");
            println!("{rule} {rounding:?}: CUDA equals the CPU bit for bit over 3 steps");
        }
    }
}
