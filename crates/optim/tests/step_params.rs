//! Stepping by handle (`step_with(StepParams::Only(ids), ..)`, what an optimizer-in-backward
//! hook calls per bucket): buckets in any order step exactly their parameters and, over a step,
//! give the bits `step()` gives (two groups, f32 and bf16 parameters, every implementation of
//! SGD and Adam); handles are resolved once, in registration order; an unknown or repeated
//! handle, and an implementation a rule lacks, are typed errors; so is a host step on a parameter
//! another thread holds (the step writes parameters through `&mut` slices), and a gradient that
//! shares the parameter's memory.

use std::num::NonZeroUsize;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::bf16;
use headroom_optim::{
    Adam, Adam8bit, Adam8bitConfig, AdamConfig, GroupOptimizer, Implementation, OptimError,
    Optimizer, ParamGroup, Scaling, SgdConfig, StepParams, UpdateRule,
};
use headroom_testkit::inputs::uniform_f32;

/// Shapes of the parameters: two groups of three, the middle one of each bf16.
const SHAPES: [&[usize]; 6] = [&[37], &[8, 9], &[500], &[3], &[40, 2], &[1000]];

fn is_bf16(idx: usize) -> bool {
    idx % 3 == 1
}

/// `values` as a tensor of the dtype of parameter `idx` (bf16 rounded on the host).
fn tensor(cpu: &BackendRef, idx: usize, values: &[f32]) -> Tensor {
    let shape = SHAPES[idx];
    if is_bf16(idx) {
        let values: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        Tensor::from_slice(cpu, &values, shape).unwrap()
    } else {
        Tensor::from_slice(cpu, values, shape).unwrap()
    }
}

fn params(cpu: &BackendRef) -> Vec<Tensor> {
    (0..SHAPES.len())
        .map(|idx| {
            let n = SHAPES[idx].iter().product();
            tensor(cpu, idx, &uniform_f32(n, idx as u64 + 1))
        })
        .collect()
}

fn set_grads(cpu: &BackendRef, params: &[Tensor], step: u64) {
    for (idx, param) in params.iter().enumerate() {
        let values = uniform_f32(param.numel(), 100 * step + idx as u64);
        param.set_grad(Some(tensor(cpu, idx, &values))).unwrap();
    }
}

/// Every parameter's bits.
fn bits(params: &[Tensor]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|p| {
            let wide = p.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            wide.iter().map(|v| v.to_bits()).collect()
        })
        .collect()
}

/// Three steps of `config` over two groups, by `step()` or by buckets of handles in a scrambled
/// order; the parameters' bits afterwards.
fn run<R: UpdateRule>(
    config: &R,
    implementation: Implementation,
    by_buckets: bool,
) -> Vec<Vec<u32>> {
    let cpu = CpuBackend::new_ref();
    let params = params(&cpu);
    let groups = vec![
        ParamGroup::new(params[..3].to_vec(), config.clone()),
        ParamGroup::new(params[3..].to_vec(), config.clone()),
    ];
    let mut optimizer = GroupOptimizer::new(groups, implementation).unwrap();
    let ids: Vec<_> = params
        .iter()
        .map(|p| optimizer.param_id(p).unwrap())
        .collect();
    let listed: Vec<_> = optimizer.params().into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids, listed, "handles in registration order");
    for step in 0..3 {
        set_grads(&cpu, &params, step);
        if by_buckets {
            // As backward finishes gradients: the last parameters first, buckets across groups
            // and dtypes.
            for bucket in [&[ids[5], ids[4]][..], &[ids[1], ids[3], ids[2]], &[ids[0]]] {
                optimizer
                    .step_with(StepParams::Only(bucket), Scaling::None)
                    .unwrap();
            }
        } else {
            optimizer.step().unwrap();
        }
    }
    for (idx, _) in params.iter().enumerate() {
        let (group, within) = (idx / 3, idx % 3);
        assert_eq!(optimizer.param_step(group, within).unwrap(), 3);
    }
    bits(&params)
}

#[test]
fn buckets_of_handles_step_as_one_step_does() {
    let implementations = [
        Implementation::Single,
        Implementation::FOREACH,
        Implementation::Foreach {
            chunk: NonZeroUsize::new(100).unwrap(),
        },
        Implementation::ForeachUnbounded,
        Implementation::Fused,
    ];
    let sgd = SgdConfig {
        momentum: 0.9,
        weight_decay: 1e-2,
        ..SgdConfig::new(0.05)
    };
    for implementation in implementations {
        let adam = AdamConfig::adamw();
        assert!(
            run(&adam, implementation, true) == run(&adam, implementation, false),
            "Adam {implementation:?}"
        );
        assert!(
            run(&sgd, implementation, true) == run(&sgd, implementation, false),
            "SGD {implementation:?}"
        );
    }
}

/// A bucket steps its parameters and nothing else, whatever other gradients exist.
#[test]
fn only_the_given_handles_step() {
    let cpu = CpuBackend::new_ref();
    let params = params(&cpu);
    set_grads(&cpu, &params, 0);
    let before = bits(&params);
    let mut adam = Adam::new(
        vec![ParamGroup::new(params.clone(), AdamConfig::adamw())],
        Implementation::Fused,
    )
    .unwrap();
    let ids: Vec<_> = adam.params().into_iter().map(|(id, _)| id).collect();
    adam.step_with(StepParams::Only(&[ids[4], ids[2]]), Scaling::None)
        .unwrap();
    let after = bits(&params);
    for idx in 0..params.len() {
        let stepped = idx == 2 || idx == 4;
        assert_eq!(before[idx] != after[idx], stepped, "parameter {idx}");
        assert_eq!(adam.param_step(0, idx).unwrap(), u64::from(stepped));
    }
}

#[test]
fn unknown_and_repeated_handles_are_typed_errors() {
    let cpu = CpuBackend::new_ref();
    let params = params(&cpu);
    set_grads(&cpu, &params, 0);
    let mut small = Adam::new(
        vec![ParamGroup::new(params[..2].to_vec(), AdamConfig::adam())],
        Implementation::Fused,
    )
    .unwrap();
    let large = Adam::new(
        vec![ParamGroup::new(params.clone(), AdamConfig::adam())],
        Implementation::Fused,
    )
    .unwrap();
    // A handle of another optimizer, past this one's table.
    let foreign = large.param_id(&params[5]).unwrap();
    let err = small
        .step_with(StepParams::Only(&[foreign]), Scaling::None)
        .unwrap_err();
    assert!(matches!(err, OptimError::UnknownParameter { .. }), "{err}");
    let err = small.param_id(&params[5]).unwrap_err();
    assert!(matches!(err, OptimError::UnknownParameter { .. }), "{err}");
    let id = small.param_id(&params[1]).unwrap();
    let err = small
        .step_with(StepParams::Only(&[id, id]), Scaling::None)
        .unwrap_err();
    assert!(matches!(err, OptimError::InvalidArgument { .. }), "{err}");
    assert_eq!(small.param_step(0, 1).unwrap(), 0, "nothing stepped");
}

/// 8-bit Adam is a rule whose only implementation is fused.
#[test]
fn implementations_a_rule_lacks_are_typed_errors() {
    let cpu = CpuBackend::new_ref();
    let param = Tensor::zeros(&cpu, &[5000], DType::F32).unwrap();
    for implementation in [
        Implementation::Single,
        Implementation::FOREACH,
        Implementation::ForeachUnbounded,
    ] {
        let err = Adam8bit::new(
            vec![ParamGroup::new(vec![param.clone()], Adam8bitConfig::adam())],
            implementation,
        )
        .unwrap_err();
        assert!(matches!(err, OptimError::Unsupported { .. }), "{err}");
    }
    let fused = Adam8bit::new(
        vec![ParamGroup::new(vec![param], Adam8bitConfig::adam())],
        Implementation::Fused,
    );
    assert!(fused.is_ok());
}

/// A host claim held elsewhere (another thread's CPU kernel) keeps a host step off its tensors:
/// the step fails whole with `ConcurrentAccess` and changes nothing; readers share, a writer
/// excludes everyone.
#[test]
fn a_step_never_writes_a_parameter_another_thread_holds() {
    use headroom_autograd_core::{Access, HostAccess, TensorError};

    let cpu = CpuBackend::new_ref();
    let values: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let param = Tensor::from_slice(&cpu, &values, &[64]).unwrap();
    param.requires_grad_(true).unwrap();
    param
        .mul(&param)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let group = ParamGroup::new(vec![param.clone()], SgdConfig::new(0.5));
    let mut sgd = GroupOptimizer::new(vec![group], Implementation::Fused).unwrap();
    let reader = HostAccess::claim("test", [(&**param.buffer(), Access::Read)]).unwrap();
    let err = sgd.step().unwrap_err();
    assert!(
        matches!(
            err,
            OptimError::Tensor(TensorError::ConcurrentAccess { .. })
        ),
        "{err}"
    );
    assert!(HostAccess::claim("test", [(&**param.buffer(), Access::Read)]).is_ok());
    drop(reader);
    assert_eq!(param.to_vec::<f32>().unwrap(), values, "nothing written");
    sgd.step().unwrap();
    assert_eq!(param.to_vec::<f32>().unwrap()[3], 3.0 - 0.5 * 6.0);
    let writer = HostAccess::claim("test", [(&**param.buffer(), Access::Write)]).unwrap();
    assert!(matches!(
        param.to_vec::<f32>(),
        Err(TensorError::ConcurrentAccess { .. })
    ));
    drop(writer);

    // A gradient that is the parameter's own memory would alias the `&mut` slice.
    param.set_grad(Some(param.detach())).unwrap();
    let err = sgd.step().unwrap_err();
    assert!(matches!(err, OptimError::UnsupportedTensor { .. }), "{err}");
}
