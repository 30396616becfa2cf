//! A user's `ElementwiseRule` through the optimizer: a host-valued gradient scale in the fused
//! form, typed errors for what the rule or the optimizer refuses, state dicts, and parameters of
//! several dtypes in one group. (`examples/custom_rule` checks Lion against a hand-written loop
//! bit for bit; the ElementwiseRule docs check SGD with sign updates.)

use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::GradScaling;
use headroom_optim::{
    ElementwiseRule, GroupOptimizer, Implementation, OptimError, Optimizer, ParamGroup, Scaling,
    StepParams, UpdateRule,
};

/// Heavy-ball momentum: `m ← μ·m + g`, `p ← p − lr·m`.
#[derive(Debug, Clone)]
struct HeavyBall {
    lr: f64,
    momentum: f64,
}

impl ElementwiseRule for HeavyBall {
    const NAME: &'static str = "HeavyBall";
    const STATES: &'static [&'static str] = &["momentum_buffer"];
    type Consts = (f32, f32);

    fn validate(&self) -> Result<(), OptimError> {
        match self.momentum >= 0.0 {
            true => Ok(()),
            false => Err(OptimError::InvalidArgument {
                op: "HeavyBall",
                reason: format!("momentum {}", self.momentum),
            }),
        }
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
    fn consts(&self, _step: u64) -> (f32, f32) {
        (self.lr as f32, self.momentum as f32)
    }
    fn update(&(lr, mu): &(f32, f32), param: f32, grad: f32, states: &mut [f32]) -> f32 {
        states[0] = mu * states[0] + grad;
        param - lr * states[0]
    }
}

/// A rule with more state tensors than the drivers carry.
#[derive(Debug, Clone)]
struct FiveStates;

impl ElementwiseRule for FiveStates {
    const NAME: &'static str = "FiveStates";
    const STATES: &'static [&'static str] = &["a", "b", "c", "d", "e"];
    type Consts = ();

    fn lr(&self) -> f64 {
        0.0
    }
    fn set_lr(&mut self, _lr: f64) {}
    fn consts(&self, _step: u64) {}
    fn update(_: &(), param: f32, _grad: f32, _states: &mut [f32]) -> f32 {
        param
    }
}

fn tensor(values: &[f32], dtype: DType) -> Tensor {
    let cpu = CpuBackend::new_ref();
    let t = Tensor::from_slice(&cpu, values, &[values.len()]).unwrap();
    t.to_dtype(dtype).unwrap()
}

fn optimizer(params: &[Tensor], implementation: Implementation) -> GroupOptimizer<HeavyBall> {
    let rule = HeavyBall {
        lr: 0.5,
        momentum: 0.9,
    };
    GroupOptimizer::new(vec![ParamGroup::new(params.to_vec(), rule)], implementation).unwrap()
}

#[test]
fn a_host_scale_in_the_fused_form_divides_each_gradient_element_and_a_set_flag_skips() {
    let (scaled, plain) = (
        tensor(&[1.0, -2.0], DType::F32),
        tensor(&[1.0, -2.0], DType::F32),
    );
    scaled
        .set_grad(Some(tensor(&[3.0, 0.75], DType::F32)))
        .unwrap();
    plain
        .set_grad(Some(tensor(&[0.75, 0.1875], DType::F32)))
        .unwrap();
    let mut with_scale = optimizer(std::slice::from_ref(&scaled), Implementation::Fused);
    let scaling = GradScaling {
        grad_scale: Some(4.0),
        found_inf: None,
    };
    with_scale
        .step_with(StepParams::All, Scaling::Host(scaling))
        .unwrap();
    optimizer(std::slice::from_ref(&plain), Implementation::Fused)
        .step()
        .unwrap();
    assert_eq!(scaled.to_vec::<f32>().unwrap(), [0.625, -2.09375]);
    assert_eq!(
        scaled.to_vec::<f32>().unwrap(),
        plain.to_vec::<f32>().unwrap()
    );
    let skip = GradScaling {
        grad_scale: Some(4.0),
        found_inf: Some(1.0),
    };
    with_scale
        .step_with(StepParams::All, Scaling::Host(skip))
        .unwrap();
    assert_eq!(scaled.to_vec::<f32>().unwrap(), [0.625, -2.09375]);
    assert_eq!(with_scale.param_step(0, 0).unwrap(), 1);
}

/// The error of building an optimizer of `rule` over `param`.
fn refusal<R: UpdateRule>(rule: R, param: &Tensor) -> OptimError {
    let group = ParamGroup::new(vec![param.clone()], rule);
    GroupOptimizer::new(vec![group], Implementation::Fused).unwrap_err()
}

#[test]
fn what_the_rule_or_the_optimizer_refuses_is_a_typed_error() {
    let param = tensor(&[1.0], DType::F32);
    let OptimError::InvalidArgument { op, reason } = refusal(FiveStates, &param) else {
        panic!("more states than the drivers carry are an invalid argument");
    };
    assert_eq!(
        (op, reason.as_str()),
        ("FiveStates", "5 state tensors, at most 4")
    );

    let negative = HeavyBall {
        lr: 0.1,
        momentum: -1.0,
    };
    let OptimError::InvalidArgument { op, reason } = refusal(negative, &param) else {
        panic!("the rule's own validation runs");
    };
    assert_eq!((op, reason.as_str()), ("HeavyBall", "momentum -1"));

    let plain = HeavyBall {
        lr: 0.1,
        momentum: 0.0,
    };
    let OptimError::DType { op, expected, got } = refusal(plain, &tensor(&[1.0], DType::I64))
    else {
        panic!("an integer parameter is a dtype error");
    };
    assert_eq!((op, expected, got), ("HeavyBall", DType::F32, DType::I64));

    param.set_grad(Some(tensor(&[1.0], DType::F32))).unwrap();
    let scaling = Scaling::Host(GradScaling {
        grad_scale: Some(2.0),
        found_inf: None,
    });
    let err = optimizer(std::slice::from_ref(&param), Implementation::Single)
        .step_with(StepParams::All, scaling)
        .unwrap_err();
    let OptimError::Unsupported { optimizer, .. } = err else {
        panic!("a gradient scale needs the fused form, not {err:?}");
    };
    assert_eq!(optimizer, "HeavyBall");
    assert_eq!(param.to_vec::<f32>().unwrap(), [1.0]);
}

#[test]
fn a_state_dict_restores_the_named_states_and_the_steps() {
    let params = [
        tensor(&[1.0, 2.0, 3.0], DType::F32),
        tensor(&[0.5], DType::F32),
    ];
    let grads = [
        tensor(&[0.25, -1.0, 2.0], DType::F32),
        tensor(&[1.0], DType::F32),
    ];
    for (param, grad) in params.iter().zip(&grads) {
        param.set_grad(Some(grad.clone())).unwrap();
    }
    let mut first = optimizer(&params, Implementation::FOREACH);
    first.step().unwrap();
    first.step().unwrap();
    let saved = first.state_dict().unwrap();
    let state = first.param_state(0, 0);
    assert_eq!(state.len(), 1);
    assert_eq!(state[0].0, "momentum_buffer");
    // m = 0.25 after one step, 0.9 * 0.25 + 0.25 after two.
    assert_eq!(state[0].1.to_vec::<f32>().unwrap()[0], 0.9f32 * 0.25 + 0.25);

    // The parameters as they are after two steps, in a fresh optimizer given the saved state.
    let copies: Vec<Tensor> = params
        .iter()
        .map(|p| tensor(&p.to_vec::<f32>().unwrap(), DType::F32))
        .collect();
    for (copy, grad) in copies.iter().zip(&grads) {
        copy.set_grad(Some(grad.clone())).unwrap();
    }
    let mut second = optimizer(&copies, Implementation::FOREACH);
    second.load_state_dict(&saved).unwrap();
    assert_eq!(second.param_step(0, 1).unwrap(), 2);
    first.step().unwrap();
    second.step().unwrap();
    for (param, copy) in params.iter().zip(&copies) {
        assert_eq!(
            param.to_vec::<f32>().unwrap(),
            copy.to_vec::<f32>().unwrap()
        );
    }
}

#[test]
fn parameters_of_three_dtypes_in_one_group_keep_states_of_their_dtype() {
    let params = [
        tensor(&[1.0, 2.0], DType::F32),
        tensor(&[1.0, 2.0], DType::BF16),
        tensor(&[1.0, 2.0], DType::F16),
    ];
    for param in &params {
        let grad = tensor(&[0.5, -0.25], param.dtype());
        param.set_grad(Some(grad)).unwrap();
    }
    let mut opt = optimizer(&params, Implementation::Single);
    opt.step().unwrap();
    for (idx, param) in params.iter().enumerate() {
        // p − 0.5·g, exact in every dtype.
        let values = param.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(values, [0.75, 2.125], "{:?}", param.dtype());
        let state = opt.param_state(0, idx);
        assert_eq!(state[0].1.dtype(), param.dtype());
    }
}
