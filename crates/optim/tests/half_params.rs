//! SGD and Adam on bf16 and f16 parameters on the CPU. The fused kernels' stored values (param,
//! momentum buffer, moments) are checked against an f64 reference of the same step from the same
//! inputs, within one rounding of the dtype, over random configurations; single and foreach agree
//! with each other bit for bit; states have the parameter's dtype and size; a bf16 state dict
//! continues a run; rules that take f32 only, and gradients of another dtype, give typed errors.
//! Stochastic rounding: unbiased, seeded and reproducible; bf16 Adam with it keeps the updates
//! that rounding to nearest loses, in 12 bytes per parameter, and its state dict continues a run.

use std::num::NonZeroUsize;

use headroom_autograd_core::{BackendRef, DType, Element, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::{
    adam_fused, bf16, f16, round_bf16_stochastic, sgd_fused, stochastic_bits, stochastic_key,
    AdafactorConfig, Adam8bitConfig, AdamBuffers, AdamConfig, GradScaling, ParamElement,
    SgdBuffers, SgdConfig, WeightDecay,
};
use headroom_optim::{
    Adafactor, Adam, Adam8bit, AdamStochastic, AdamStochasticConfig, GroupOptimizer,
    Implementation, OptimError, Optimizer, ParamGroup, Sgd, UpdateRule,
};

/// The 2-byte element types, with their bits.
trait Half: ParamElement + Element + PartialEq {
    fn bits(self) -> u16;
    fn of_bits(bits: u16) -> Self;
}

impl Half for bf16 {
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn of_bits(bits: u16) -> bf16 {
        bf16::from_bits(bits)
    }
}

impl Half for f16 {
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn of_bits(bits: u16) -> f16 {
        f16::from_bits(bits)
    }
}

/// xorshift64 values uniform in [-scale/2, scale/2).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    fn values<T: ParamElement>(&mut self, n: usize, scale: f64) -> Vec<T> {
        (0..n)
            .map(|_| T::from_f32(((self.next() - 0.5) * scale) as f32))
            .collect()
    }

    fn coin(&mut self) -> bool {
        self.next() < 0.5
    }
}

/// The spacing of `T` at `x` (one rounding's worst error is at most this).
fn ulp<T: Half>(x: f64) -> f64 {
    let rounded = T::from_f32(x.abs() as f32);
    f64::from(T::of_bits(rounded.bits() + 1).to_f32() - rounded.to_f32())
}

/// Checks that a stored value is the f64 reference rounded once: within one ulp of `T`, plus the
/// float32 arithmetic's error on terms of magnitude `terms`.
fn check_rounding<T: Half>(what: &str, got: T, want: f64, terms: f64) {
    let err = (f64::from(got.to_f32()) - want).abs();
    let tol = ulp::<T>(want) + 1e-6 * terms;
    assert!(
        err <= tol,
        "{what}: got {got:?}, reference {want:e}, error {err:e} > {tol:e}"
    );
}

fn wide<T: ParamElement>(x: T) -> f64 {
    f64::from(x.to_f32())
}

fn sgd_fused_within_one_rounding<T: Half>(seed: u64) {
    let mut rng = Rng(seed);
    let momentum = if rng.coin() {
        0.5 + 0.45 * rng.next()
    } else {
        0.0
    };
    let dampening = if rng.coin() { 0.1 } else { 0.0 };
    let cfg = SgdConfig {
        lr: 1e-3 + 0.1 * rng.next(),
        momentum,
        dampening,
        weight_decay: if rng.coin() { 1e-2 } else { 0.0 },
        nesterov: momentum > 0.0 && dampening == 0.0 && rng.coin(),
        maximize: rng.coin(),
    };
    let n = 1000;
    let mut param: Vec<T> = rng.values(n, 2.0);
    let mut buf: Vec<T> = vec![T::from_f32(0.0); n];
    for step in 1..=3u64 {
        let grad: Vec<T> = rng.values(n, 0.5);
        let (old_param, old_buf) = (param.clone(), buf.clone());
        let bufs = SgdBuffers {
            param: &mut param,
            grad: &grad,
            momentum_buffer: cfg.has_momentum().then_some(&mut buf[..]),
            first_step: step == 1,
        };
        sgd_fused(&cfg, bufs, GradScaling::NONE).unwrap();
        for i in 0..n {
            let p = wide(old_param[i]);
            let mut g = wide(grad[i]);
            if cfg.maximize {
                g = -g;
            }
            g += cfg.weight_decay * p;
            if cfg.has_momentum() {
                let (scaled, added) = (cfg.momentum * wide(old_buf[i]), (1.0 - cfg.dampening) * g);
                let want = if step == 1 { g } else { scaled + added };
                let terms = scaled.abs() + added.abs();
                check_rounding(
                    &format!("{cfg:?} step {step} buf[{i}]"),
                    buf[i],
                    want,
                    terms,
                );
                // The update reads the stored buffer back, as PyTorch's fused SGD does.
                let stored = wide(buf[i]);
                g = if cfg.nesterov {
                    g + cfg.momentum * stored
                } else {
                    stored
                };
            }
            let want = p - cfg.lr * g;
            let terms = p.abs() + (cfg.lr * g).abs();
            check_rounding(
                &format!("{cfg:?} step {step} param[{i}]"),
                param[i],
                want,
                terms,
            );
        }
    }
}

fn adam_fused_within_one_rounding<T: Half>(seed: u64) {
    let mut rng = Rng(seed);
    let weight_decay = if rng.coin() { 1e-2 } else { 0.0 };
    let cfg = AdamConfig {
        lr: 1e-4 + 1e-2 * rng.next(),
        betas: (0.8 + 0.15 * rng.next(), 0.99 + 0.0099 * rng.next()),
        eps: if rng.coin() { 1e-8 } else { 1e-6 },
        weight_decay,
        decay: if rng.coin() {
            WeightDecay::L2
        } else {
            WeightDecay::Decoupled
        },
        amsgrad: rng.coin(),
        maximize: rng.coin(),
    };
    let grad_scale = rng.coin().then_some(64.0f32);
    let n = 1000;
    let mut param: Vec<T> = rng.values(n, 2.0);
    let zeros = vec![T::from_f32(0.0); n];
    let (mut m, mut v, mut vmax) = (zeros.clone(), zeros.clone(), zeros);
    let (beta1, beta2) = cfg.betas;
    for step in 1..=3u64 {
        let grad: Vec<T> = rng.values(n, 0.5 * f64::from(grad_scale.unwrap_or(1.0)));
        let (old_p, old_m, old_v, old_vmax) = (param.clone(), m.clone(), v.clone(), vmax.clone());
        let bufs = AdamBuffers {
            param: &mut param,
            grad: &grad,
            exp_avg: &mut m,
            exp_avg_sq: &mut v,
            max_exp_avg_sq: cfg.amsgrad.then_some(&mut vmax[..]),
        };
        let scaling = GradScaling {
            grad_scale,
            found_inf: None,
        };
        adam_fused(&cfg, step, bufs, scaling).unwrap();
        let t = step as f64;
        let (bias_correction1, bias_correction2) = (1.0 - beta1.powf(t), 1.0 - beta2.powf(t));
        for i in 0..n {
            let what = |name: &str| format!("{cfg:?} scale {grad_scale:?} step {step} {name}[{i}]");
            let mut p = wide(old_p[i]);
            let mut g = wide(grad[i]) / f64::from(grad_scale.unwrap_or(1.0));
            if cfg.maximize {
                g = -g;
            }
            match cfg.decay {
                WeightDecay::L2 => g += cfg.weight_decay * p,
                WeightDecay::Decoupled => p *= 1.0 - cfg.lr * cfg.weight_decay,
            }
            let (m_kept, m_added) = (beta1 * wide(old_m[i]), (1.0 - beta1) * g);
            let m_new = m_kept + m_added;
            check_rounding(&what("exp_avg"), m[i], m_new, m_kept.abs() + m_added.abs());
            let v_new = beta2 * wide(old_v[i]) + (1.0 - beta2) * g * g;
            check_rounding(&what("exp_avg_sq"), v[i], v_new, v_new);
            let second = if cfg.amsgrad {
                let vmax_new = wide(old_vmax[i]).max(v_new);
                check_rounding(&what("max_exp_avg_sq"), vmax[i], vmax_new, vmax_new);
                vmax_new
            } else {
                v_new
            };
            let denom = second.sqrt() / bias_correction2.sqrt() + cfg.eps;
            let update = cfg.lr / bias_correction1 * m_new / denom;
            check_rounding(&what("param"), param[i], p - update, p.abs() + update.abs());
        }
    }
}

#[test]
fn fused_updates_round_each_stored_value_once() {
    for seed in 1..=8u64 {
        sgd_fused_within_one_rounding::<bf16>(seed);
        sgd_fused_within_one_rounding::<f16>(seed + 100);
        adam_fused_within_one_rounding::<bf16>(seed + 200);
        adam_fused_within_one_rounding::<f16>(seed + 300);
    }
}

const SHAPES: [&[usize]; 3] = [&[37], &[300, 7], &[1500]];

/// Three steps of `config` with `implementation` on parameters of `T`; the params' and states'
/// bits afterwards.
fn run<T: Half, R: UpdateRule>(
    backend: &BackendRef,
    config: &R,
    implementation: Implementation,
) -> Vec<Vec<u16>> {
    let mut rng = Rng(7);
    let params: Vec<Tensor> = SHAPES
        .iter()
        .map(|shape| {
            let values: Vec<T> = rng.values(shape.iter().product(), 2.0);
            Tensor::from_slice(backend, &values, shape).unwrap()
        })
        .collect();
    let mut optimizer = GroupOptimizer::new(
        vec![ParamGroup::new(params.clone(), config.clone())],
        implementation,
    )
    .unwrap();
    for _ in 0..3 {
        for (param, shape) in params.iter().zip(SHAPES) {
            let grad: Vec<T> = rng.values(shape.iter().product(), 0.5);
            param
                .set_grad(Some(Tensor::from_slice(backend, &grad, shape).unwrap()))
                .unwrap();
        }
        optimizer.step().unwrap();
    }
    let bits =
        |t: &Tensor| -> Vec<u16> { t.to_vec::<T>().unwrap().iter().map(|x| x.bits()).collect() };
    let mut res: Vec<Vec<u16>> = params.iter().map(bits).collect();
    for idx in 0..params.len() {
        for (name, state) in optimizer.param_state(0, idx) {
            assert_eq!(state.dtype(), <T as Element>::DTYPE, "{name}");
            res.push(bits(&state));
        }
    }
    res
}

fn single_and_foreach_agree<T: Half, R: UpdateRule>(config: R) {
    let cpu = CpuBackend::new_ref();
    let want = run::<T, R>(&cpu, &config, Implementation::Single);
    for implementation in [
        Implementation::FOREACH,
        Implementation::Foreach {
            chunk: NonZeroUsize::new(100).unwrap(),
        },
        Implementation::ForeachUnbounded,
    ] {
        let got = run::<T, R>(&cpu, &config, implementation);
        assert!(
            got == want,
            "{config:?} {implementation:?} differs from Single"
        );
    }
}

#[test]
fn single_and_foreach_forms_agree_bit_for_bit() {
    let sgd = SgdConfig {
        momentum: 0.9,
        dampening: 0.1,
        weight_decay: 1e-2,
        maximize: true,
        ..SgdConfig::new(0.05)
    };
    let nesterov = SgdConfig {
        momentum: 0.8,
        nesterov: true,
        ..SgdConfig::new(0.05)
    };
    let amsgrad = AdamConfig {
        amsgrad: true,
        weight_decay: 1e-2,
        maximize: true,
        ..AdamConfig::adam()
    };
    single_and_foreach_agree::<bf16, _>(sgd.clone());
    single_and_foreach_agree::<f16, _>(sgd);
    single_and_foreach_agree::<bf16, _>(nesterov);
    single_and_foreach_agree::<bf16, _>(AdamConfig::adamw());
    single_and_foreach_agree::<f16, _>(AdamConfig::adamw());
    single_and_foreach_agree::<bf16, _>(amsgrad);
}

/// One group of f32 and bf16 parameters steps each dtype as an optimizer of that dtype alone.
#[test]
fn mixed_dtypes_in_one_group_step_per_dtype() {
    let cpu = CpuBackend::new_ref();
    let mut rng = Rng(5);
    let (p32, g32): (Vec<f32>, Vec<f32>) = (rng.values(100, 2.0), rng.values(100, 0.5));
    let (p16, g16): (Vec<bf16>, Vec<bf16>) = (rng.values(60, 2.0), rng.values(60, 0.5));
    let make = |params: Vec<Tensor>| {
        Adam::new(
            vec![ParamGroup::new(params, AdamConfig::adamw())],
            Implementation::FOREACH,
        )
        .unwrap()
    };
    let step = |adam: &mut Adam, params: &[&Tensor], grads: &[Tensor]| {
        for (param, grad) in params.iter().zip(grads) {
            param.set_grad(Some(grad.clone())).unwrap();
        }
        adam.step().unwrap();
    };
    let tensors = || {
        (
            Tensor::from_slice(&cpu, &p32, &[100]).unwrap(),
            Tensor::from_slice(&cpu, &p16, &[60]).unwrap(),
        )
    };
    let grads = [
        Tensor::from_slice(&cpu, &g32, &[100]).unwrap(),
        Tensor::from_slice(&cpu, &g16, &[60]).unwrap(),
    ];
    let (a32, a16) = tensors();
    let mut mixed = make(vec![a16.clone(), a32.clone()]);
    step(
        &mut mixed,
        &[&a16, &a32],
        &[grads[1].clone(), grads[0].clone()],
    );
    let (b32, b16) = tensors();
    step(&mut make(vec![b32.clone()]), &[&b32], &grads[..1]);
    step(&mut make(vec![b16.clone()]), &[&b16], &grads[1..]);
    assert_eq!(a32.to_vec::<f32>().unwrap(), b32.to_vec::<f32>().unwrap());
    assert_eq!(a16.to_vec::<bf16>().unwrap(), b16.to_vec::<bf16>().unwrap());
}

/// AdamW's first fused step on a bf16 1024×1024 weight adds its two moments in bf16: 4 MiB.
#[test]
fn bf16_states_take_two_bytes_per_element() {
    let cpu = CpuBackend::new_ref();
    let values = vec![bf16::from_f32(0.5); 1 << 20];
    let weight = Tensor::from_slice(&cpu, &values, &[1024, 1024]).unwrap();
    weight
        .set_grad(Some(
            Tensor::from_slice(&cpu, &values, &[1024, 1024]).unwrap(),
        ))
        .unwrap();
    let mut adam = Adam::new(
        vec![ParamGroup::new(vec![weight.clone()], AdamConfig::adamw())],
        Implementation::Fused,
    )
    .unwrap();
    adam.step().unwrap();
    for (name, state) in adam.param_state(0, 0) {
        assert_eq!(
            (state.dtype(), state.buffer().allocated_bytes()),
            (DType::BF16, 1 << 21),
            "{name}"
        );
    }
}

/// A bf16 run saved after two steps and loaded into a fresh optimizer continues bit for bit.
#[test]
fn bf16_state_dict_continues_the_run() {
    let cpu = CpuBackend::new_ref();
    let mut rng = Rng(11);
    let start: Vec<bf16> = rng.values(300, 2.0);
    let grads: Vec<Vec<bf16>> = (0..4).map(|_| rng.values(300, 0.5)).collect();
    let config = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::new(0.1)
    };
    let fresh = |values: &[bf16]| {
        let param = Tensor::from_slice(&cpu, values, &[300]).unwrap();
        let sgd = Sgd::new(
            vec![ParamGroup::new(vec![param.clone()], config.clone())],
            Implementation::Fused,
        )
        .unwrap();
        (param, sgd)
    };
    let step = |param: &Tensor, sgd: &mut Sgd, grad: &[bf16]| {
        param
            .set_grad(Some(Tensor::from_slice(&cpu, grad, &[300]).unwrap()))
            .unwrap();
        sgd.step().unwrap();
    };
    let (param, mut sgd) = fresh(&start);
    for grad in &grads {
        step(&param, &mut sgd, grad);
    }
    let (resumed, mut sgd2) = fresh(&start);
    for grad in &grads[..2] {
        step(&resumed, &mut sgd2, grad);
    }
    let saved = sgd2.state_dict().unwrap();
    let (param3, mut sgd3) = fresh(&resumed.to_vec::<bf16>().unwrap());
    sgd3.load_state_dict(&saved).unwrap();
    assert_eq!(sgd3.param_state(0, 0)[0].1.dtype(), DType::BF16);
    for grad in &grads[2..] {
        step(&param3, &mut sgd3, grad);
    }
    assert_eq!(
        param3.to_vec::<bf16>().unwrap(),
        param.to_vec::<bf16>().unwrap()
    );
}

#[test]
fn f32_only_rules_and_mismatched_gradients_give_typed_errors() {
    let cpu = CpuBackend::new_ref();
    let param = Tensor::zeros(&cpu, &[64], DType::BF16).unwrap();
    let err = Adafactor::new(
        vec![ParamGroup::new(vec![param.clone()], AdafactorConfig::new())],
        Implementation::Fused,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            OptimError::DType {
                got: DType::BF16,
                ..
            }
        ),
        "{err}"
    );
    // The block-wise rules take bf16 (tests/blockwise_bf16.rs), not f16.
    let f16_param = Tensor::zeros(&cpu, &[64], DType::F16).unwrap();
    let err = Adam8bit::new(
        vec![ParamGroup::new(vec![f16_param], Adam8bitConfig::adam())],
        Implementation::Fused,
    )
    .unwrap_err();
    assert!(
        matches!(err, OptimError::DType { got, .. } if got == DType::F16),
        "{err}"
    );
    let mut adam = Adam::new(
        vec![ParamGroup::new(vec![param.clone()], AdamConfig::adam())],
        Implementation::Fused,
    )
    .unwrap();
    if param
        .set_grad(Some(Tensor::zeros(&cpu, &[64], DType::F32).unwrap()))
        .is_ok()
    {
        let err = adam.step().unwrap_err();
        assert!(
            matches!(
                err,
                OptimError::DType {
                    expected: DType::BF16,
                    got: DType::F32,
                    ..
                }
            ),
            "{err}"
        );
    }
}

/// Rounded stochastically, a value between two bf16 neighbours goes up as often as its distance
/// from the lower one says (here 1/8 of 65,536 draws, within 5 standard deviations); values bf16
/// holds, infinities and NaN are left as rounding to nearest leaves them; the bits depend on the
/// seed, the parameter and the step.
#[test]
fn stochastic_rounding_is_unbiased_and_seeded() {
    let n = 1u64 << 16;
    let key = stochastic_key(1, 0, 1);
    for (value, below, above) in [
        (1.0 + 2f32.powi(-10), 1.0, 1.0 + 2f32.powi(-7)),
        (-(1.0 + 2f32.powi(-10)), -1.0, -(1.0 + 2f32.powi(-7))),
    ] {
        let mut ups = 0u64;
        for i in 0..n {
            let r = round_bf16_stochastic(value, stochastic_bits(key, i)).to_f32();
            assert!(r == below || r == above, "{value} rounded to {r}");
            ups += u64::from(r == above);
        }
        let (mean, sd) = (n as f64 / 8.0, (n as f64 * 7.0 / 64.0).sqrt());
        assert!(
            (ups as f64 - mean).abs() < 5.0 * sd,
            "{value}: {ups} of {n} up"
        );
    }
    for exact in [
        0.0f32,
        1.0,
        -2.5,
        bf16::MAX.to_f32(),
        f32::INFINITY,
        f32::NEG_INFINITY,
    ] {
        for i in 0..64 {
            assert_eq!(
                round_bf16_stochastic(exact, stochastic_bits(key, i)).to_f32(),
                bf16::from_f32(exact).to_f32()
            );
        }
    }
    assert_eq!(
        round_bf16_stochastic(f32::NAN, 0).to_bits(),
        0x7fc0,
        "one canonical NaN"
    );
    // Four neighbours share one 64-bit hash, each its own 16 bits of it: the fields of a group
    // repeat no more often than independent 16-bit draws would (4,096 groups of 6 pairs: 0.375
    // repeats expected).
    let repeats = (0..4096u64)
        .map(|j| {
            let fields: Vec<u32> = (0..4).map(|k| stochastic_bits(key, 4 * j + k)).collect();
            (0..4)
                .flat_map(|a| (a + 1..4).map(move |b| (a, b)))
                .filter(|&(a, b)| fields[a] == fields[b])
                .count()
        })
        .sum::<usize>();
    assert!(repeats <= 2, "{repeats} repeated fields");
    let stream = |key: u64| (0..64).map(|i| stochastic_bits(key, i)).collect::<Vec<_>>();
    assert_eq!(
        stream(stochastic_key(1, 0, 1)),
        stream(stochastic_key(1, 0, 1))
    );
    for other in [
        stochastic_key(2, 0, 1),
        stochastic_key(1, 1, 1),
        stochastic_key(1, 0, 2),
    ] {
        assert_ne!(stream(key), stream(other));
    }
}

/// A bf16 parameter at 1.0 whose Adam update (lr 1e-4 a step) is far below half a bf16 ulp:
/// rounded to nearest it never moves; with stochastic rounding its mean follows the f32 update
/// (100 steps: 0.99), the run is the same for the same seed and differs for another, and the
/// moments are f32 — 2 + 2 + 8 = 12 bytes per parameter.
#[test]
fn stochastic_adam_keeps_small_updates_in_twelve_bytes() {
    let cpu = CpuBackend::new_ref();
    let n = 4096;
    let adam = AdamConfig {
        lr: 1e-4,
        ..AdamConfig::adam()
    };
    let run = |rule: Option<u64>| {
        let param = Tensor::from_slice(&cpu, &vec![bf16::ONE; n], &[n]).unwrap();
        let mut optimizer: Box<dyn Optimizer> = match rule {
            Some(seed) => Box::new(
                AdamStochastic::new(
                    vec![ParamGroup::new(
                        vec![param.clone()],
                        AdamStochasticConfig::new(adam.clone(), seed),
                    )],
                    Implementation::Fused,
                )
                .unwrap(),
            ),
            None => Box::new(
                Adam::new(
                    vec![ParamGroup::new(vec![param.clone()], adam.clone())],
                    Implementation::Fused,
                )
                .unwrap(),
            ),
        };
        for _ in 0..100 {
            let grad = Tensor::from_slice(&cpu, &vec![bf16::ONE; n], &[n]).unwrap();
            param.set_grad(Some(grad)).unwrap();
            optimizer.step().unwrap();
        }
        param.to_vec::<bf16>().unwrap()
    };
    let nearest = run(None);
    assert!(
        nearest.iter().all(|&p| p == bf16::ONE),
        "rounding to nearest loses every step"
    );
    let stochastic = run(Some(5));
    let mean = stochastic
        .iter()
        .map(|p| f64::from(p.to_f32()))
        .sum::<f64>()
        / n as f64;
    assert!((mean - 0.99).abs() < 1e-3, "mean {mean}");
    assert_eq!(run(Some(5)), stochastic, "same seed, same bits");
    assert_ne!(run(Some(6)), stochastic, "another seed, other bits");

    let param = Tensor::from_slice(&cpu, &vec![bf16::ONE; n], &[n]).unwrap();
    param
        .set_grad(Some(
            Tensor::from_slice(&cpu, &vec![bf16::ONE; n], &[n]).unwrap(),
        ))
        .unwrap();
    let mut optimizer = AdamStochastic::new(
        vec![ParamGroup::new(
            vec![param.clone()],
            AdamStochasticConfig::new(adam, 5),
        )],
        Implementation::Fused,
    )
    .unwrap();
    optimizer.step().unwrap();
    let state_bytes: usize = optimizer
        .param_state(0, 0)
        .iter()
        .map(|(_, t)| {
            assert_eq!(t.dtype(), DType::F32);
            t.numel() * 4
        })
        .sum();
    let param_bytes = 2 * n;
    let grad_bytes = 2 * n;
    assert_eq!(param_bytes + grad_bytes + state_bytes, 12 * n);
    // Only the fused form, only bf16.
    let f32_param = Tensor::zeros(&cpu, &[4], DType::F32).unwrap();
    let config = AdamStochasticConfig::new(AdamConfig::adam(), 0);
    assert!(matches!(
        AdamStochastic::new(
            vec![ParamGroup::new(vec![f32_param], config.clone())],
            Implementation::Fused
        ),
        Err(OptimError::DType {
            expected: DType::BF16,
            ..
        })
    ));
    let bf16_param = Tensor::zeros(&cpu, &[4], DType::BF16).unwrap();
    assert!(matches!(
        AdamStochastic::new(
            vec![ParamGroup::new(vec![bf16_param], config)],
            Implementation::Single
        ),
        Err(OptimError::Unsupported { .. })
    ));
}

/// A stochastic-rounding run saved after two steps and loaded into a fresh optimizer continues
/// bit for bit: the moments are restored in f32 and the random stream follows the step count.
#[test]
fn stochastic_adam_state_dict_continues_the_run() {
    let cpu = CpuBackend::new_ref();
    let mut rng = Rng(23);
    let start: Vec<bf16> = rng.values(500, 2.0);
    let grads: Vec<Vec<bf16>> = (0..4).map(|_| rng.values(500, 0.5)).collect();
    let config = AdamStochasticConfig::new(AdamConfig::adamw(), 9);
    let fresh = |values: &[bf16]| {
        let param = Tensor::from_slice(&cpu, values, &[500]).unwrap();
        let adam = AdamStochastic::new(
            vec![ParamGroup::new(vec![param.clone()], config.clone())],
            Implementation::Fused,
        )
        .unwrap();
        (param, adam)
    };
    let step = |param: &Tensor, adam: &mut AdamStochastic, grad: &[bf16]| {
        param
            .set_grad(Some(Tensor::from_slice(&cpu, grad, &[500]).unwrap()))
            .unwrap();
        adam.step().unwrap();
    };
    let (param, mut adam) = fresh(&start);
    for grad in &grads {
        step(&param, &mut adam, grad);
    }
    let (resumed, mut adam2) = fresh(&start);
    for grad in &grads[..2] {
        step(&resumed, &mut adam2, grad);
    }
    let saved = adam2.state_dict().unwrap();
    let (param3, mut adam3) = fresh(&resumed.to_vec::<bf16>().unwrap());
    adam3.load_state_dict(&saved).unwrap();
    for grad in &grads[2..] {
        step(&param3, &mut adam3, grad);
    }
    assert_eq!(
        param3.to_vec::<bf16>().unwrap(),
        param.to_vec::<bf16>().unwrap()
    );
}

/// Stochastic Adam with bf16 moments (torchao's `_AdamW` layout: 4 bytes of state a parameter):
/// each step reads the moments widened and stores their new values rounded to nearest-even, and
/// the parameter's update uses the values before that rounding. So from equal inputs the new
/// parameter equals the f32-moment kernel's to the bit, and each stored moment is that kernel's
/// moment rounded once; over later steps the two runs part by those roundings alone.
#[test]
fn bf16_moments_are_the_f32_moments_rounded_once_per_step() {
    use headroom_optim::kernels::{adam_fused_stochastic, AdamStochasticBuffers};

    let n = 4099;
    let cfg = AdamConfig {
        lr: 1e-3,
        weight_decay: 0.01,
        ..AdamConfig::adamw()
    };
    let mut stream = headroom_testkit::inputs::Xorshift::from_state(77);
    let mut values =
        |scale: f32| -> Vec<f32> { (0..n).map(|_| stream.next_signed_f32() * scale).collect() };
    let mut param_wide: Vec<bf16> = values(2.0).into_iter().map(bf16::from_f32).collect();
    let mut param_half = param_wide.clone();
    let (mut m_half, mut v_half) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
    for step in 1..=4u64 {
        let grad: Vec<bf16> = values(1.0).into_iter().map(bf16::from_f32).collect();
        // The f32-moment kernel from the bf16 run's moments, widened: the same inputs.
        let mut m_wide: Vec<f32> = m_half.iter().map(|m| m.to_f32()).collect();
        let mut v_wide: Vec<f32> = v_half.iter().map(|v| v.to_f32()).collect();
        param_wide.clone_from(&param_half);
        let key = stochastic_key(3, 1, step);
        let wide = AdamStochasticBuffers {
            param: &mut param_wide,
            grad: &grad,
            exp_avg: &mut m_wide,
            exp_avg_sq: &mut v_wide,
            max_exp_avg_sq: None,
        };
        adam_fused_stochastic(&cfg, step, key, wide, GradScaling::NONE).unwrap();
        let half = AdamStochasticBuffers {
            param: &mut param_half,
            grad: &grad,
            exp_avg: &mut m_half,
            exp_avg_sq: &mut v_half,
            max_exp_avg_sq: None,
        };
        adam_fused_stochastic(&cfg, step, key, half, GradScaling::NONE).unwrap();
        assert_eq!(param_half, param_wide, "step {step}");
        let rounded = |wide: &[f32]| wide.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        assert_eq!(m_half, rounded(&m_wide), "exp_avg, step {step}");
        assert_eq!(v_half, rounded(&v_wide), "exp_avg_sq, step {step}");
        assert!(
            m_wide.iter().zip(&m_half).any(|(w, h)| *w != h.to_f32()),
            "nothing rounded"
        );
    }
}
