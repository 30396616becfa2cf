//! Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023) as an
//! [`ElementwiseRule`]: one state tensor (the momentum `exp_avg`), the update of one element in
//! f32, and a hand-written loop of the same update that the optimizer's forms are checked
//! against, bit for bit.
//!
//! Per element, with `c = β1·m + (1−β1)·g`: `p ← p·(1 − lr·λ) − lr·sign(c)`, then
//! `m ← β2·m + (1−β2)·g`. The constants are computed once per step in f64 and rounded to f32.

use headroom::autograd_core::{BackendRef, DType, Tensor};
use headroom::optim::kernels::{bf16, ParamElement};
use headroom::optim::{
    ElementwiseRule, GroupOptimizer, Implementation, OptimError, Optimizer, ParamGroup,
};

/// Lion's hyperparameters.
#[derive(Debug, Clone)]
pub(crate) struct Lion {
    /// Learning rate.
    pub(crate) lr: f64,
    /// Interpolation of the update's direction (`β1`) and of the momentum (`β2`).
    pub(crate) betas: (f64, f64),
    /// Decoupled weight decay.
    pub(crate) weight_decay: f64,
}

/// One step's constants, as the f32 the update computes with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LionConsts {
    lr: f32,
    decay: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
}

impl LionConsts {
    fn new(lion: &Lion) -> LionConsts {
        let (beta1, beta2) = lion.betas;
        LionConsts {
            lr: lion.lr as f32,
            decay: (1.0 - lion.lr * lion.weight_decay) as f32,
            beta1: beta1 as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
        }
    }

    /// One element: the new parameter, and the momentum updated in place.
    fn update(&self, param: f32, grad: f32, exp_avg: &mut f32) -> f32 {
        let direction = self.beta1 * *exp_avg + self.one_minus_beta1 * grad;
        let sign = if direction == 0.0 {
            0.0
        } else {
            direction.signum()
        };
        *exp_avg = self.beta2 * *exp_avg + self.one_minus_beta2 * grad;
        param * self.decay - self.lr * sign
    }
}

impl ElementwiseRule for Lion {
    const NAME: &'static str = "Lion";
    const STATES: &'static [&'static str] = &["exp_avg"];
    type Consts = LionConsts;

    fn validate(&self) -> Result<(), OptimError> {
        let (beta1, beta2) = self.betas;
        let in_range = |beta: f64| (0.0..1.0).contains(&beta);
        if !(self.lr >= 0.0 && in_range(beta1) && in_range(beta2) && self.weight_decay >= 0.0) {
            return Err(OptimError::InvalidArgument {
                op: "Lion",
                reason: format!("{self:?}: lr and weight decay at least 0, betas in [0, 1)"),
            });
        }
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn consts(&self, _step: u64) -> LionConsts {
        LionConsts::new(self)
    }

    fn update(consts: &LionConsts, param: f32, grad: f32, states: &mut [f32]) -> f32 {
        consts.update(param, grad, &mut states[0])
    }
}

/// The parameters (at step 0) and the gradients of step `step` of the check, tensors of `lens`
/// elements; the largest spans several blocks of the host driver, so its parallel path runs too.
fn inputs(lens: &[usize], step: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let value = |i: usize, salt: usize| ((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.5 - 1.0;
    let params = lens
        .iter()
        .enumerate()
        .map(|(t, &n)| (0..n).map(|i| value(i, t)).collect())
        .collect();
    let grads = lens
        .iter()
        .enumerate()
        .map(|(t, &n)| {
            (0..n)
                .map(|i| value(i, 31 * (step + 1) + t) * 0.1)
                .collect()
        })
        .collect();
    (params, grads)
}

/// `steps` Lion steps of `T` parameters through a `GroupOptimizer` with `implementation`, and the
/// parameters and momenta after them (as f32).
fn with_optimizer<T: ParamElement>(
    backend: &BackendRef,
    lion: &Lion,
    implementation: Implementation,
    lens: &[usize],
    steps: usize,
) -> Result<Run, Box<dyn std::error::Error>> {
    let (values, _) = inputs(lens, 0);
    let params: Vec<Tensor> = values
        .iter()
        .map(|v| Tensor::from_slice(backend, v, &[v.len()])?.to_dtype(T::DTYPE))
        .collect::<Result<_, _>>()?;
    let mut optimizer = GroupOptimizer::new(
        vec![ParamGroup::new(params.clone(), lion.clone())],
        implementation,
    )?;
    for step in 0..steps {
        let (_, grads) = inputs(lens, step);
        for (param, grad) in params.iter().zip(&grads) {
            let grad = Tensor::from_slice(backend, grad, &[grad.len()])?.to_dtype(T::DTYPE)?;
            param.set_grad(Some(grad))?;
        }
        optimizer.step()?;
    }
    let as_f32 = |t: &Tensor| t.to_dtype(DType::F32)?.to_vec::<f32>();
    let mut exp_avgs = Vec::with_capacity(params.len());
    for idx in 0..params.len() {
        let state = optimizer.param_state(0, idx);
        let [("exp_avg", exp_avg)] = state.as_slice() else {
            return Err(format!("Lion's state is exp_avg alone, not {state:?}").into());
        };
        exp_avgs.push(as_f32(exp_avg)?);
    }
    Ok(Run {
        params: params.iter().map(as_f32).collect::<Result<_, _>>()?,
        exp_avgs,
    })
}

/// Parameters and momenta after some steps, as f32.
#[derive(Debug, PartialEq)]
struct Run {
    params: Vec<Vec<f32>>,
    exp_avgs: Vec<Vec<f32>>,
}

impl Run {
    /// Every value's bits, parameters first.
    fn bits(&self) -> Vec<u32> {
        let values = self.params.iter().chain(&self.exp_avgs).flatten();
        values.map(|x| x.to_bits()).collect()
    }
}

/// The same steps written out: each value held in `T`, computed in f32 by the same per-element
/// function (`LionConsts::update`), stored rounded once — plain loops, so what the comparison
/// checks is the drivers: loading and rounding, the state, the forms, the parallel blocks.
fn by_hand<T: ParamElement>(lion: &Lion, lens: &[usize], steps: usize) -> Run {
    let consts = LionConsts::new(lion);
    let round = |x: f32| T::from_f32(x).to_f32();
    let (values, _) = inputs(lens, 0);
    let mut params: Vec<Vec<f32>> = values
        .iter()
        .map(|v| v.iter().map(|&x| round(x)).collect())
        .collect();
    let mut exp_avgs: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n]).collect();
    for step in 0..steps {
        let (_, grads) = inputs(lens, step);
        for ((param, exp_avg), grad) in params.iter_mut().zip(&mut exp_avgs).zip(&grads) {
            for ((p, m), &g) in param.iter_mut().zip(exp_avg.iter_mut()).zip(grad) {
                let mut momentum = *m;
                *p = round(consts.update(*p, round(g), &mut momentum));
                *m = round(momentum);
            }
        }
    }
    Run { params, exp_avgs }
}

/// Checks the fused, bounded foreach and single forms against [`by_hand`], bit for bit (every
/// parameter and momentum element), for f32 and bf16 parameters on `backend`; returns how many
/// parameter elements each run compared.
pub(crate) fn check(backend: &BackendRef) -> Result<usize, Box<dyn std::error::Error>> {
    let lion = Lion {
        lr: 1e-2,
        betas: (0.9, 0.99),
        weight_decay: 0.1,
    };
    let (lens, steps) = ([7usize, 1000, 70_000], 4);
    let implementations = [
        Implementation::Fused,
        Implementation::FOREACH,
        Implementation::Single,
    ];
    for implementation in implementations {
        let f32_run = with_optimizer::<f32>(backend, &lion, implementation, &lens, steps)?;
        let bf16_run = with_optimizer::<bf16>(backend, &lion, implementation, &lens, steps)?;
        for (dtype, run, expected) in [
            ("f32", f32_run, by_hand::<f32>(&lion, &lens, steps)),
            ("bf16", bf16_run, by_hand::<bf16>(&lion, &lens, steps)),
        ] {
            if run.bits() != expected.bits() {
                return Err(
                    format!("Lion {implementation:?} on {dtype} differs from the loop").into(),
                );
            }
        }
    }
    Ok(lens.iter().sum())
}
