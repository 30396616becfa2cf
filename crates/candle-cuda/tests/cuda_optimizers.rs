//! Headroom's candle optimizers on CUDA `Var`s (needs a CUDA device: the tests are ignored
//! elsewhere, and with `HEADROOM_REQUIRE_GPU=1` a missing device fails them): over 20 steps fed
//! the same gradients, every optimizer's parameters on CUDA equal headroom-candle's on the CPU
//! bit for bit (AdamW f32/bf16/f16, AdamWStochastic, AdamW8bit with an 8-bit and a 32-bit-state
//! Var, SGD with momentum), and `AdamW` stays within 8 f32 epsilons of max(|p|, lr) of
//! `candle_nn::AdamW` on the same device (the CPU test in headroom-candle says why); a run resumed from a saved state file gives the bits of the run that never
//! stopped; a step allocates nothing on the device after the first; typed errors for what
//! cannot be stepped.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use headroom_candle_cuda::{
    Adam8bitConfig, AdamConfig, AdamStochasticConfig, AdamW, AdamW8bit, AdamWStochastic, Sgd,
    SgdConfig,
};
use headroom_testkit::worst::nan_max_f32;

const STEPS: usize = 20;
/// Elements of the Vars: one over bitsandbytes' 4096-element threshold (8-bit state, a partial
/// last block), one under it (f32 state), one odd.
const SIZES: [usize; 3] = [5000, 300, 33];

/// candle's CUDA device 0, or `None` (testkit's skip notice) without one; with
/// `HEADROOM_REQUIRE_GPU=1` a missing device fails the test.
fn cuda() -> Option<Device> {
    headroom_testkit::gpu::cuda_or_skip(Device::new_cuda(0))
}

/// `n` values of a xorshift stream keyed by `seed`, in [-scale, scale).
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Vars of `SIZES`, of `dtype`, on `device`, from the same values whatever the device.
fn vars(dtype: DType, device: &Device) -> Vec<Var> {
    SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let t = Tensor::from_vec(values(i as u64 + 1, n, 1.0), n, device).unwrap();
            Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
        })
        .collect()
}

/// Step `step`'s gradients of `vars`: the same values on every device; the second Var gets none
/// on odd steps (its step count falls behind the others').
fn grads(vars: &[Var], step: usize) -> GradStore {
    grads_of(vars, step, true)
}

/// Step `step`'s gradients of `vars`, the second Var's skipped on odd steps when `skip`.
fn grads_of(vars: &[Var], step: usize, skip: bool) -> GradStore {
    let mut store = GradStore::default();
    for (i, var) in vars.iter().enumerate() {
        if skip && i == 1 && step % 2 == 1 {
            continue;
        }
        let g = values(1000 * step as u64 + i as u64, var.elem_count(), 0.1);
        let g = Tensor::from_vec(g, var.elem_count(), var.device()).unwrap();
        store.insert(var.as_tensor(), g.to_dtype(var.dtype()).unwrap());
    }
    store
}

/// Every Var's elements as f32 bits, on the host.
fn bits(vars: &[Var]) -> Vec<Vec<u32>> {
    vars.iter()
        .map(|v| {
            let f = v
                .as_tensor()
                .to_dtype(DType::F32)
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap();
            f.to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

/// `STEPS` steps of the optimizer `make` builds, on `device`'s Vars of `dtype`.
fn run<O: Optimizer>(
    dtype: DType,
    device: &Device,
    make: impl FnOnce(Vec<Var>) -> O,
) -> Vec<Vec<u32>> {
    run_skipping(true, dtype, device, make)
}

/// [`run`], the second Var's gradient skipped on odd steps when `skip`.
fn run_skipping<O: Optimizer>(
    skip: bool,
    dtype: DType,
    device: &Device,
    make: impl FnOnce(Vec<Var>) -> O,
) -> Vec<Vec<u32>> {
    let vars = vars(dtype, device);
    let mut optimizer = make(vars.clone());
    for step in 0..STEPS {
        optimizer.step(&grads_of(&vars, step, skip)).unwrap();
    }
    bits(&vars)
}

/// The CUDA run of `make` equals its CPU run bit for bit, and the CUDA optimizer stepped on CUDA.
fn same_bits_as_the_cpu<O: Optimizer>(dtype: DType, make: impl Fn(Vec<Var>) -> O) {
    let Some(gpu) = cuda() else { return };
    let on_cpu = run(dtype, &Device::Cpu, &make);
    let on_gpu = run(dtype, &gpu, &make);
    for (i, (c, g)) in on_cpu.iter().zip(&on_gpu).enumerate() {
        let differ = c.iter().zip(g).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ,
            0,
            "{dtype:?} Var {i}: {differ} of {} elements differ",
            c.len()
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn adamw_on_cuda_equals_the_cpu_bit_for_bit() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        same_bits_as_the_cpu(dtype, |vars| {
            let config = AdamConfig {
                lr: 1e-2,
                weight_decay: 0.01,
                ..AdamConfig::adamw()
            };
            AdamW::new(vars, config).unwrap()
        });
    }
    same_bits_as_the_cpu(DType::F32, |vars| {
        let config = AdamConfig {
            lr: 1e-2,
            amsgrad: true,
            ..AdamConfig::adam()
        };
        AdamW::new(vars, config).unwrap()
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn stochastic_adamw_on_cuda_equals_the_cpu_bit_for_bit() {
    same_bits_as_the_cpu(DType::BF16, |vars| {
        let config = AdamStochasticConfig {
            adam: AdamConfig {
                lr: 1e-2,
                ..AdamConfig::adamw()
            },
            seed: 7,
        };
        AdamWStochastic::new(vars, config).unwrap()
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn adamw8bit_on_cuda_equals_the_cpu_bit_for_bit() {
    same_bits_as_the_cpu(DType::F32, |vars| {
        let config = Adam8bitConfig {
            lr: 1e-2,
            ..Adam8bitConfig::adamw()
        };
        AdamW8bit::new(vars, config).unwrap()
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn sgd_on_cuda_equals_the_cpu_bit_for_bit() {
    for dtype in [DType::F32, DType::BF16] {
        same_bits_as_the_cpu(dtype, |vars| {
            let config = SgdConfig {
                momentum: 0.9,
                nesterov: true,
                weight_decay: 1e-3,
                ..SgdConfig::new(1e-2)
            };
            Sgd::new(vars, config).unwrap()
        });
    }
}

/// The distance in f32 ulps between two finite floats of one sign.
fn ulps(a: u32, b: u32) -> u32 {
    (a as i64 - b as i64).unsigned_abs() as u32
}

#[test]
#[ignore = "needs a CUDA device"]
fn adamw_on_cuda_stays_within_8_epsilons_of_candle_nn_adamw() {
    // Every Var gets a gradient every step: candle_nn::AdamW counts one step for all its Vars,
    // where PyTorch (and Headroom) count each Var's own steps.
    let Some(gpu) = cuda() else { return };
    let ours = run_skipping(false, DType::F32, &gpu, |vars| {
        let config = AdamConfig {
            lr: 1e-3,
            ..AdamConfig::adamw()
        };
        AdamW::new(vars, config).unwrap()
    });
    let candle = run_skipping(false, DType::F32, &gpu, |vars| {
        let params = candle_nn::ParamsAdamW {
            lr: 1e-3,
            ..Default::default()
        };
        candle_nn::AdamW::new(vars, params).unwrap()
    });
    let (mut counts, mut worst) = ([0usize; 3], 0f32);
    for (a, b) in ours.iter().flatten().zip(candle.iter().flatten()) {
        let (x, y) = (f32::from_bits(*a), f32::from_bits(*b));
        counts[(ulps(*a, *b) as usize).min(2)] += 1;
        worst = nan_max_f32(worst, (x - y).abs() / (f32::EPSILON * x.abs().max(1e-3)));
    }
    println!(
        "against candle_nn::AdamW after {STEPS} steps: {} equal, {} one ulp apart, {} more; \
         worst {worst:.2} epsilons of max(|p|, lr)",
        counts[0], counts[1], counts[2]
    );
    assert!(worst <= 8.0, "{worst} epsilons of max(|p|, lr)");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_resumed_run_gives_the_bits_of_one_that_never_stopped() {
    let Some(gpu) = cuda() else { return };
    let config = Adam8bitConfig {
        lr: 1e-2,
        ..Adam8bitConfig::adamw()
    };
    let straight = run(DType::F32, &gpu, |vars| {
        AdamW8bit::new(vars, config.clone()).unwrap()
    });
    let vars = vars(DType::F32, &gpu);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.safetensors");
    let mut first = AdamW8bit::new(vars.clone(), config.clone()).unwrap();
    for step in 0..STEPS / 2 {
        first.step(&grads(&vars, step)).unwrap();
    }
    first.save_state(&path).unwrap();
    drop(first);
    let mut second = AdamW8bit::new(vars.clone(), config).unwrap();
    second.load_state(&path).unwrap();
    assert!(second.on_cuda());
    assert_eq!(second.var_step(1), Some(STEPS as u64 / 4));
    for step in STEPS / 2..STEPS {
        second.step(&grads(&vars, step)).unwrap();
    }
    assert_eq!(bits(&vars), straight);
}

/// The device pool's bytes in use now and at most since the last reset (candle allocates from
/// the device's default memory pool).
fn pool_bytes() -> (u64, u64) {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    // SAFETY: attribute reads and a reset of device 0's default pool, on a live context (the
    // caller made a candle CUDA device); the out-pointers are u64s.
    unsafe {
        let device = result::device::get(0).unwrap();
        let pool = result::device::get_default_mem_pool(device).unwrap();
        let mut used = 0u64;
        let mut high = 0u64;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT;
        sys::cuMemPoolGetAttribute(pool, attr, (&mut used as *mut u64).cast())
            .result()
            .unwrap();
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        sys::cuMemPoolGetAttribute(pool, attr, (&mut high as *mut u64).cast())
            .result()
            .unwrap();
        let mut zero = 0u64;
        sys::cuMemPoolSetAttribute(pool, attr, (&mut zero as *mut u64).cast())
            .result()
            .unwrap();
        (used, high)
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_step_allocates_nothing_on_the_device_after_the_first() {
    let Some(gpu) = cuda() else { return };
    let vars = vars(DType::F32, &gpu);
    let mut ours = AdamW::new(vars.clone(), AdamConfig::adamw()).unwrap();
    ours.step(&grads(&vars, 0)).unwrap();
    let grads = grads(&vars, 2);
    gpu.synchronize().unwrap();
    let (before, _) = pool_bytes();
    ours.step(&grads).unwrap();
    gpu.synchronize().unwrap();
    let (after, high) = pool_bytes();
    assert_eq!(
        (after, high),
        (before, before),
        "the step allocated on the device"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn what_cannot_be_stepped_is_a_typed_error() {
    let Some(gpu) = cuda() else { return };
    let message = |e: candle_core::Error| e.to_string();
    // Vars on two devices.
    let mixed = vec![
        vars(DType::F32, &gpu)[0].clone(),
        vars(DType::F32, &Device::Cpu)[0].clone(),
    ];
    let e = message(AdamW::new(mixed, AdamConfig::adamw()).unwrap_err());
    assert!(e.contains("one device"), "{e}");
    // 8-bit AdamW takes f32 Vars on CUDA.
    let e = message(AdamW8bit::new(vars(DType::F16, &gpu), Adam8bitConfig::adamw()).unwrap_err());
    assert!(e.contains("F16"), "{e}");
    // A gradient of another dtype: refused, nothing written, no step counted.
    let vars = vars(DType::F32, &gpu);
    let before = bits(&vars);
    let mut ours = AdamW::new(vars.clone(), AdamConfig::adamw()).unwrap();
    let mut wrong = GradStore::default();
    wrong.insert(
        vars[0].as_tensor(),
        vars[0].as_tensor().to_dtype(DType::BF16).unwrap(),
    );
    let e = message(ours.step(&wrong).unwrap_err());
    assert!(e.contains("gradient"), "{e}");
    assert_eq!((bits(&vars), ours.var_step(0)), (before, Some(0)));
    // A non-contiguous gradient.
    let mut strided = GradStore::default();
    let g = Tensor::zeros((SIZES[0], 2), DType::F32, &gpu)
        .unwrap()
        .narrow(1, 0, 1)
        .unwrap()
        .squeeze(1)
        .unwrap();
    strided.insert(vars[0].as_tensor(), g);
    let e = message(ours.step(&strided).unwrap_err());
    assert!(e.contains("non-contiguous"), "{e}");
    // A state dict of another dtype.
    ours.step(&grads(&vars, 0)).unwrap();
    let mut dict = ours.state_dict().unwrap();
    let exp_avg = dict["0.exp_avg"].to_dtype(DType::BF16).unwrap();
    dict.insert("0.exp_avg".into(), exp_avg);
    let e = message(ours.load_state_dict(&dict).unwrap_err());
    assert!(e.contains("exp_avg"), "{e}");
}
