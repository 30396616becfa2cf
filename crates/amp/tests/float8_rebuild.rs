//! fp8 linears' outputs rebuilt in backward (`Float8Policy::with_rebuilt_outputs`, on by
//! default): an op that saves a listed linear's output (a GELU linear its pre-activation, a
//! product its operands, views of one projection like attention's q and k) keeps no bytes of it;
//! backward makes the output again from the linear's saved codes. The values and gradients equal
//! the run that keeps the output, bit for bit; exactly the output's bytes are not kept; views of
//! one output share one rebuild; a weight stepped in place before backward is the typed error;
//! nothing is left once backward is done.

use headroom_amp::{AmpPolicy, Float8Policy};
use headroom_autograd_core::{BackendRef, DType, Tensor, TensorError};
use headroom_ops_cpu::CpuBackend;

fn values(n: usize, step: f64) -> Vec<f64> {
    (0..n).map(|i| (i as f64 * step).sin()).collect()
}

fn leaf(backend: &BackendRef, v: Vec<f64>, shape: &[usize]) -> Tensor {
    let t = Tensor::from_f64s(backend, &v, shape, DType::F32).unwrap();
    t.requires_grad_(true).unwrap();
    t
}

/// The parameters of a small block: a projection up (`w1`, `b1`), one down (`w2`), and a
/// projection to two halves (`wq`).
struct Block {
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    wq: Tensor,
}

const ROWS: usize = 48;
const WIDTH: usize = 32;
const HIDDEN: usize = 64;

impl Block {
    fn new(backend: &BackendRef) -> Block {
        Block {
            w1: leaf(backend, values(HIDDEN * WIDTH, 0.13), &[HIDDEN, WIDTH]),
            b1: leaf(backend, values(HIDDEN, 0.7), &[HIDDEN]),
            w2: leaf(backend, values(WIDTH * HIDDEN, 0.29), &[WIDTH, HIDDEN]),
            wq: leaf(
                backend,
                values(2 * WIDTH * WIDTH, 0.31),
                &[2 * WIDTH, WIDTH],
            ),
        }
    }

    fn parameters(&self) -> [&Tensor; 4] {
        [&self.w1, &self.b1, &self.w2, &self.wq]
    }

    /// An MLP (`gelu_tanh_linear` saves `w1`'s output) plus the product of two halves of
    /// `wq`'s output (the product saves both views).
    fn forward(&self, x: &Tensor) -> Tensor {
        let pre = x.linear(&self.w1, Some(&self.b1)).unwrap();
        let mlp = pre.gelu_tanh_linear(&self.w2, None).unwrap();
        let halves = x.linear(&self.wq, None).unwrap();
        let q = halves.narrow(1, 0, WIDTH).unwrap();
        let k = halves.narrow(1, WIDTH, WIDTH).unwrap();
        mlp.add(&q.mul(&k).unwrap()).unwrap()
    }
}

/// The output, the input's and every parameter's gradient (bits), and the bytes the forward
/// kept, with the outputs rebuilt or kept.
fn run(
    cpu: &std::sync::Arc<CpuBackend>,
    block: &Block,
    base: Option<AmpPolicy>,
    rebuild: bool,
) -> (Vec<Vec<u64>>, u64) {
    let backend: BackendRef = cpu.clone();
    let allocated = || cpu.allocator().memory_allocated();
    let x = leaf(&backend, values(ROWS * WIDTH, 0.37), &[ROWS, WIDTH]);
    let policy = Float8Policy::new(base)
        .with_weight(&block.w1)
        .with_weight(&block.w2)
        .with_weight(&block.wq)
        .with_rebuilt_outputs(rebuild);
    let before = allocated();
    let y = {
        let _fp8 = policy.enter();
        block.forward(&x)
    };
    let kept = allocated() - before;
    y.sum_all().unwrap().backward().unwrap();
    let bits = |t: &Tensor| -> Vec<u64> {
        t.to_vec_f64()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    let mut res = vec![bits(&y), bits(&x.grad().unwrap())];
    for p in block.parameters() {
        res.push(bits(&p.take_grad().unwrap()));
    }
    (res, kept)
}

#[test]
fn rebuilt_outputs_give_the_same_bits_and_keep_fewer_bytes() {
    let cpu = std::sync::Arc::new(CpuBackend::default());
    let backend: BackendRef = cpu.clone();
    let block = Block::new(&backend);
    let start = cpu.allocator().memory_allocated();
    for base in [None, Some(AmpPolicy::torch_cuda(DType::BF16).unwrap())] {
        let output_bytes = match base {
            None => 4,
            Some(_) => 2,
        };
        let (kept_values, kept_bytes) = run(&cpu, &block, base.clone(), false);
        let (rebuilt_values, rebuilt_bytes) = run(&cpu, &block, base.clone(), true);
        assert_eq!(kept_values, rebuilt_values, "bf16 base: {}", base.is_some());
        // `w1`'s output ([48, 64]) and `wq`'s ([48, 64]: both halves, one storage) are not kept.
        let outputs = 2 * (ROWS * HIDDEN * output_bytes) as u64;
        assert_eq!(
            kept_bytes - rebuilt_bytes,
            outputs,
            "bf16: {}",
            base.is_some()
        );
        assert_eq!(cpu.allocator().memory_allocated(), start, "nothing is left");
    }
}

#[test]
fn a_weight_stepped_before_backward_is_the_typed_error() {
    let cpu = std::sync::Arc::new(CpuBackend::default());
    let backend: BackendRef = cpu.clone();
    let block = Block::new(&backend);
    let x = leaf(&backend, values(ROWS * WIDTH, 0.37), &[ROWS, WIDTH]);
    let policy = Float8Policy::new(None::<AmpPolicy>)
        .with_weight(&block.w1)
        .with_weight(&block.w2);
    let y = {
        let _fp8 = policy.enter();
        let pre = x.linear(&block.w1, Some(&block.b1)).unwrap();
        pre.gelu_tanh_linear(&block.w2, None).unwrap()
    };
    // An optimizer's step on w1 between forward and backward: the rebuild would differ.
    let w1 = block.w1.detach();
    w1.add_(&w1.mul_scalar(0.5).unwrap()).unwrap();
    let err = y.sum_all().unwrap().backward().unwrap_err();
    assert!(
        matches!(
            err,
            TensorError::ModifiedInPlace {
                op: "linear_float8",
                ..
            }
        ),
        "{err:?}"
    );
}

/// Under saved-tensor hooks that keep nothing (as checkpointing's pack does), the rebuild recipe
/// holds no bytes either: it shares the linear's own saves of its codes, so the forward keeps
/// what it keeps with the outputs kept (only the outputs themselves, held by the caller).
#[test]
fn hooks_that_drop_the_saves_drop_what_rebuilds_would_read() {
    use headroom_autograd_core::{saved_tensor_hooks, Packed};
    let cpu = std::sync::Arc::new(CpuBackend::default());
    let backend: BackendRef = cpu.clone();
    let block = Block::new(&backend);
    let x = leaf(&backend, values(ROWS * WIDTH, 0.37), &[ROWS, WIDTH]);
    let mut kept = Vec::new();
    for rebuild in [false, true] {
        let policy = Float8Policy::new(None::<AmpPolicy>)
            .with_weight(&block.w1)
            .with_weight(&block.w2)
            .with_weight(&block.wq)
            .with_rebuilt_outputs(rebuild);
        let before = cpu.allocator().memory_allocated();
        let y = {
            let _fp8 = policy.enter();
            let _hooks = saved_tensor_hooks(
                |_, _| Ok(Box::new(()) as Packed),
                |_| {
                    Err(TensorError::InvalidArgument {
                        op: "test",
                        reason: "dropped".to_owned(),
                    })
                },
            );
            block.forward(&x)
        };
        kept.push(cpu.allocator().memory_allocated() - before);
        drop(y);
    }
    assert_eq!(
        kept[0], kept[1],
        "bytes kept with the outputs kept, and rebuilt"
    );
}
