//! The technique matrix on the CPU: every driver × every way to keep saves × every precision ×
//! both optimizers, on a tiny ViT and a tiny GPT-2 (`matrix/mod.rs` says what each is and why the
//! bounds hold), 5 steps each against the plain loop, in parallel over the machine's cores; and
//! offload, the one technique the CPU refuses, refused with checkpoint's typed error.

use std::time::Instant;

use headroom_autograd_core::{BackendRef, DType};
use headroom_checkpoint::CheckpointError;
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::inputs::Xorshift;

mod matrix;
use matrix::{assert_within_bounds, attach, cells, model_name, train, Saves, DRIVERS};

/// `jobs` run on as many threads as the machine has cores, results in order.
fn run_all<T: Send>(jobs: Vec<Box<dyn FnOnce() -> T + Send>>) -> Vec<T> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let jobs: Vec<_> = jobs.into_iter().map(Some).collect();
    let slots = std::sync::Mutex::new((jobs, 0usize));
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let (index, job) = {
                    let mut slots = slots.lock().unwrap();
                    let index = slots.1;
                    if index == slots.0.len() {
                        return;
                    }
                    slots.1 += 1;
                    (index, slots.0[index].take().expect("taken once"))
                };
                let result = job();
                results.lock().unwrap().push((index, result));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(index, _)| *index);
    results.into_iter().map(|(_, result)| result).collect()
}

#[test]
fn every_technique_stacks_with_every_other_and_trains_like_the_plain_loop() {
    let started = Instant::now();
    let cells = cells(
        &[Saves::Keep, Saves::Checkpoint, Saves::Compress8bit],
        &DRIVERS,
    );
    assert_eq!(cells.len(), 2 * 3 * 2 * 9);
    let jobs: Vec<Box<dyn FnOnce() -> Vec<Vec<f32>> + Send>> = cells
        .iter()
        .map(|&cell| {
            Box::new(move || train(cell, &CpuBackend::new_ref())) as Box<dyn FnOnce() -> _ + Send>
        })
        .collect();
    let trained = run_all(jobs);
    assert_within_bounds(&cells, &trained, false, started);
}

/// Offload's cells on the CPU: the first block's forward refuses with
/// `CheckpointError::OffloadNeedsCuda` (carried through nn and the engine), for both models.
#[test]
fn offload_is_refused_on_the_cpu_with_a_typed_error() {
    let cpu: BackendRef = CpuBackend::new_ref();
    for cell in cells(&[Saves::Offload], &[matrix::Driver::Plain]) {
        let mut model = cell.group.model.build(&cpu, DType::F32, 28).unwrap();
        attach(&mut model, Saves::Offload);
        let batch = cell
            .group
            .model
            .batch(&cpu, DType::F32, 2, &mut Xorshift::new(1))
            .unwrap();
        let err = model.forward(&batch.input).unwrap_err();
        let refusal = std::iter::successors(
            Some(err.as_ref() as &(dyn std::error::Error + 'static)),
            |e| e.source(),
        )
        .find_map(|e| e.downcast_ref::<CheckpointError>());
        assert!(
            matches!(refusal, Some(CheckpointError::OffloadNeedsCuda { reason }) if reason.contains("Cpu")),
            "{}: {err:?}",
            model_name(cell.group.model)
        );
    }
}
