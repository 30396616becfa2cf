//! Snapshot and trace files through the public API: PyTorch's own snapshot pickle and TSV trace
//! (from `testdata/`, see its README), round trips through our pickle and JSON writers, what our
//! pickles contain, and how bad input fails.
//!
//! The expected figures for the two recorded files were computed with Python 3's `pickle` and
//! `gzip` modules from the same files and are hard-coded here.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use headroom_caching_allocator::{
    pickle_opcodes, read_json, read_pickle, read_trace_tsv, trace_events_from_snapshot, write_json,
    write_pickle, AllocError, BlockSnapshot, BlockState, Frame, Frames, PoolKind, SegmentSnapshot,
    Snapshot, TraceAction, TraceEntry, TraceEvent, Value, VIEWER_OPCODES,
};
use proptest::prelude::*;

/// A test-data file, from the crate's folder or (a binary carried elsewhere) the repo root.
fn testdata(name: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata")
        .join(name);
    if built.exists() {
        built
    } else {
        PathBuf::from("testdata").join(name)
    }
}

fn read_vit() -> Snapshot {
    let file = std::fs::File::open(testdata("vit_l16_b8_adam_3steps.pickle"))
        .expect("testdata/vit_l16_b8_adam_3steps.pickle is in the repository");
    read_pickle(std::io::BufReader::new(file)).expect("PyTorch's snapshot reads")
}

fn pickle_bytes(snapshot: &Snapshot) -> Vec<u8> {
    let mut out = Vec::new();
    write_pickle(snapshot, &mut out).expect("the snapshot's values fit a pickle");
    out
}

fn json_bytes(snapshot: &Snapshot) -> Vec<u8> {
    let mut out = Vec::new();
    write_json(snapshot, &mut out).expect("the snapshot's values fit JSON");
    out
}

fn context(names: &[&str]) -> Frames {
    names.iter().copied().map(Frame::context).collect()
}

fn entry(action: TraceAction, addr: u64, size: u64, frames: &Frames) -> TraceEntry {
    TraceEntry {
        action,
        addr,
        size,
        stream: 0,
        time_us: 1_795_990_231_334_080,
        frames: frames.clone(),
    }
}

/// A snapshot with every state, action, pool kind and frame shape the model has; `n_extra`
/// more allocations (with distinct frames) make batches and long memo indices.
fn sample_snapshot(n_extra: u64) -> Snapshot {
    let forward = context(&["mlp", "encoder.3", "forward"]);
    let python: Frames = vec![
        Frame {
            filename: "/opt/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py".into(),
            line: 125,
            name: "forward".into(),
        },
        Frame {
            filename: format!("/home/é/{}.py", "deep/".repeat(60)),
            line: 9,
            name: "train_step".into(),
        },
    ]
    .into();
    let none = context(&[]);
    let small = 0x7f00_0000_0000;
    let large = 0x7f10_0000_0000;
    let mut trace = vec![
        entry(TraceAction::SegmentAlloc, small, 2 << 20, &forward),
        entry(TraceAction::Alloc, small, 1000, &forward),
        entry(TraceAction::Alloc, small + 1024, 500, &python),
        entry(TraceAction::FreeRequested, small + 1024, 500, &python),
        entry(TraceAction::SegmentMap, large, 20 << 20, &none),
        entry(TraceAction::Oom, 123_456_789, 1 << 40, &forward),
        entry(TraceAction::Snapshot, 0, 1536, &none),
        entry(TraceAction::Free, small + 4096, 512, &none),
        entry(TraceAction::FreeCompleted, small + 4096, 512, &none),
        entry(TraceAction::SegmentUnmap, large, 2 << 20, &none),
        entry(
            TraceAction::SegmentFree,
            large + (40 << 20),
            20 << 20,
            &none,
        ),
    ];
    for idx in 0..n_extra {
        let frames = context(&[&format!("layer{}", idx / 4), "forward"]);
        trace.push(TraceEntry {
            stream: idx % 3,
            time_us: -1 - idx as i64,
            ..entry(TraceAction::Alloc, large + idx * 512, 512, &frames)
        });
    }
    Snapshot {
        segments: vec![
            SegmentSnapshot {
                device: 0,
                address: small,
                total_size: 2 << 20,
                allocated_size: 1024,
                active_size: 1536,
                requested_size: 1500,
                stream: 0,
                segment_type: PoolKind::Small,
                segment_pool_id: (0, 0),
                is_expandable: false,
                frames: forward.clone(),
                blocks: vec![
                    BlockSnapshot {
                        address: small,
                        size: 1024,
                        requested_size: 1000,
                        state: BlockState::ActiveAllocated,
                        frames: forward.clone(),
                    },
                    BlockSnapshot {
                        address: small + 1024,
                        size: 512,
                        requested_size: 500,
                        state: BlockState::ActivePendingFree,
                        frames: python.clone(),
                    },
                    BlockSnapshot {
                        address: small + 1536,
                        size: (2 << 20) - 1536,
                        requested_size: 0,
                        state: BlockState::Inactive,
                        frames: none.clone(),
                    },
                ],
            },
            SegmentSnapshot {
                device: 1,
                address: large,
                total_size: 20 << 20,
                allocated_size: 0,
                active_size: 0,
                requested_size: 0,
                stream: 0x5555_1234_5678,
                segment_type: PoolKind::Large,
                segment_pool_id: (1, 7),
                is_expandable: true,
                frames: none.clone(),
                blocks: vec![BlockSnapshot {
                    address: large,
                    size: 20 << 20,
                    requested_size: 0,
                    state: BlockState::Inactive,
                    frames: none,
                }],
            },
        ],
        device_traces: vec![trace, Vec::new()],
        allocator_settings: vec![
            (
                "PYTORCH_CUDA_ALLOC_CONF".into(),
                Value::Str("expandable_segments:True".into()),
            ),
            ("max_split_size".into(), Value::Int(-1)),
            ("garbage_collection_threshold".into(), Value::Float(0.6)),
            ("expandable_segments".into(), Value::Bool(true)),
            ("last".into(), Value::None),
            (
                "roundup_power2_divisions".into(),
                Value::Dict(
                    [("1", 0), ("2", 4), ("1024", 8)]
                        .into_iter()
                        .map(|(key, int)| (Value::Str(key.into()), Value::Int(int)))
                        .collect(),
                ),
            ),
        ],
        external_annotations: vec![Value::Dict(vec![
            (Value::Str("stage".into()), Value::Str("START".into())),
            (
                Value::Str("name".into()),
                Value::Str("Optimizer.step#Adam.step".into()),
            ),
            (Value::Str("device".into()), Value::Int(0)),
            (
                Value::Str("time_us".into()),
                Value::Int(1_795_990_231_685_489),
            ),
        ])],
    }
}

#[test]
fn reads_pytorchs_vit_snapshot() {
    let snapshot = read_vit();

    // Segments: 406 (6 small, 400 large), 1,149 blocks, all on device 0, stream 0, pool (0, 0).
    assert_eq!(snapshot.segments.len(), 406);
    let n_small = snapshot
        .segments
        .iter()
        .filter(|segment| segment.segment_type == PoolKind::Small)
        .count();
    assert_eq!(n_small, 6);
    let n_blocks: usize = snapshot
        .segments
        .iter()
        .map(|segment| segment.blocks.len())
        .sum();
    assert_eq!(n_blocks, 1149);
    for segment in &snapshot.segments {
        assert_eq!((segment.device, segment.stream), (0, 0));
        assert_eq!(segment.segment_pool_id, (0, 0));
        assert!(!segment.is_expandable);
        let mut address = segment.address;
        for block in &segment.blocks {
            assert_eq!(block.address, address, "blocks tile their segment");
            address += block.size;
        }
        assert_eq!(address - segment.address, segment.total_size);
        let allocated: u64 = segment
            .blocks
            .iter()
            .filter(|block| block.state == BlockState::ActiveAllocated)
            .map(|block| block.size)
            .sum();
        assert_eq!(allocated, segment.allocated_size);
    }
    assert!(snapshot
        .segments
        .windows(2)
        .all(|pair| pair[0].address < pair[1].address));

    // Reserved bytes at the end equal PyTorch's peak reserved for this run.
    let total: u64 = snapshot
        .segments
        .iter()
        .map(|segment| segment.total_size)
        .sum();
    assert_eq!(total, 7_952_400_384);
    let allocated: u64 = snapshot
        .segments
        .iter()
        .map(|segment| segment.allocated_size)
        .sum();
    let active: u64 = snapshot
        .segments
        .iter()
        .map(|segment| segment.active_size)
        .sum();
    let requested: u64 = snapshot
        .segments
        .iter()
        .map(|segment| segment.requested_size)
        .sum();
    assert_eq!(
        (allocated, active, requested),
        (3_728_334_848, 3_728_334_848, 3_724_893_920)
    );

    let mut by_state: HashMap<BlockState, (usize, u64, u64)> = HashMap::new();
    for block in snapshot.segments.iter().flat_map(|segment| &segment.blocks) {
        let acc = by_state.entry(block.state).or_default();
        *acc = (acc.0 + 1, acc.1 + block.size, acc.2 + block.requested_size);
        assert!(block.frames.is_empty(), "recorded with context=None");
    }
    assert_eq!(
        by_state[&BlockState::ActiveAllocated],
        (892, 3_728_334_848, 3_724_893_920)
    );
    assert_eq!(
        by_state[&BlockState::Inactive],
        (257, 4_224_065_536, 3_942_758_824)
    );
    assert!(!by_state.contains_key(&BlockState::ActivePendingFree));

    // History: one device, 18,737 entries.
    assert_eq!(snapshot.device_traces.len(), 1);
    let trace = &snapshot.device_traces[0];
    assert_eq!(trace.len(), 18_737);
    let mut counts: HashMap<TraceAction, usize> = HashMap::new();
    for entry in trace {
        *counts.entry(entry.action).or_default() += 1;
    }
    let expected_counts = HashMap::from([
        (TraceAction::Alloc, 6532),
        (TraceAction::FreeRequested, 5937),
        (TraceAction::FreeCompleted, 5937),
        (TraceAction::SegmentAlloc, 331),
    ]);
    assert_eq!(counts, expected_counts);
    let alloc_bytes: u64 = trace
        .iter()
        .filter(|entry| entry.action == TraceAction::Alloc)
        .map(|entry| entry.size)
        .sum();
    assert_eq!(alloc_bytes, 49_409_432_856);
    assert_eq!(
        (
            trace[0].action,
            trace[0].addr,
            trace[0].size,
            trace[0].time_us
        ),
        (
            TraceAction::Alloc,
            140_448_220_413_952,
            6_422_528,
            1_795_990_231_334_080
        )
    );
    let last = &trace[trace.len() - 1];
    assert_eq!(
        (last.action, last.addr, last.size, last.time_us),
        (
            TraceAction::FreeCompleted,
            140_441_525_978_112,
            4000,
            1_795_990_231_899_130
        )
    );

    // Settings and annotations come through as values.
    let settings: HashMap<&str, &Value> = snapshot
        .allocator_settings
        .iter()
        .map(|(name, value)| (name.as_str(), value))
        .collect();
    assert_eq!(snapshot.allocator_settings.len(), 9);
    assert_eq!(settings["max_split_size"], &Value::Int(-1));
    assert_eq!(settings["garbage_collection_threshold"], &Value::Float(0.0));
    assert_eq!(settings["expandable_segments"], &Value::Bool(false));
    let Value::Dict(divisions) = settings["roundup_power2_divisions"] else {
        panic!("roundup_power2_divisions is a dict");
    };
    assert_eq!(divisions.len(), 16);
    assert_eq!(divisions[10], (Value::Str("1024".into()), Value::Int(0)));
    assert_eq!(snapshot.external_annotations.len(), 12);

    // The history replays like a TSV trace.
    let events = trace_events_from_snapshot(&snapshot);
    assert_eq!(events.len(), 18_737);
    assert_eq!(
        events[0],
        TraceEvent {
            action: TraceAction::Alloc,
            addr: 140_448_220_413_952,
            size: 6_422_528,
            stream: 0,
        }
    );
}

#[test]
fn vit_snapshot_round_trips_through_pickle_and_json() {
    let snapshot = read_vit();
    let pickled = pickle_bytes(&snapshot);
    assert_eq!(read_pickle(&pickled[..]).expect("reads back"), snapshot);
    let json = json_bytes(&snapshot);
    assert_eq!(read_json(&json[..]).expect("reads back"), snapshot);
    // PyTorch's file is 1,427,705 bytes; ours drops `compile_context` and `user_metadata` but
    // writes `frames`, and memoizes only strings.
    assert!(pickled.len() < 1_600_000, "{} bytes", pickled.len());
}

#[test]
fn sample_snapshot_round_trips_through_pickle_and_json() {
    let snapshot = sample_snapshot(2500);
    let pickled = pickle_bytes(&snapshot);
    assert_eq!(read_pickle(&pickled[..]).expect("reads back"), snapshot);
    let json = json_bytes(&snapshot);
    assert_eq!(read_json(&json[..]).expect("reads back"), snapshot);
    // Writing is deterministic.
    assert_eq!(pickle_bytes(&snapshot), pickled);
}

#[test]
fn pickles_are_protocol_4_within_the_viewers_opcodes() {
    let pickled = pickle_bytes(&sample_snapshot(2500));
    assert_eq!(&pickled[..2], &[0x80, 4], "PROTO 4");
    assert_eq!(pickled.last(), Some(&b'.'), "STOP");
    // The 32 opcodes of MemoryViz.js's unpickler (no BINUNICODE8, no bytes, no globals).
    assert_eq!(VIEWER_OPCODES.len(), 32);
    let mut viewer = VIEWER_OPCODES.to_vec();
    viewer.sort_unstable();
    assert_eq!(
        viewer,
        [
            b'(', b'.', b'G', b'J', b'K', b'M', b'N', b'X', b'a', b'd', b'e', b'h', b'j', b'l',
            b'q', b'r', b's', b't', b'u', b'}', b']', b')', 0x80, 0x85, 0x86, 0x87, 0x88, 0x89,
            0x8a, 0x8c, 0x94, 0x95
        ]
        .into_iter()
        .collect::<std::collections::BTreeSet<u8>>()
        .into_iter()
        .collect::<Vec<u8>>()
    );
    // Every opcode our files use is among them (Python's `pickletools` agrees, see
    // `python_reads_our_files`); PyTorch's own file also keeps to them.
    let vit = std::fs::read(testdata("vit_l16_b8_adam_3steps.pickle")).expect("testdata");
    let ours = pickle_bytes(&read_pickle(&vit[..]).expect("reads"));
    for bytes in [&pickled, &ours, &vit] {
        let used = pickle_opcodes(bytes).expect("walks");
        assert_eq!(used[0], 0x80, "PROTO first");
        let outside: Vec<u8> = used
            .iter()
            .copied()
            .filter(|code| !VIEWER_OPCODES.contains(code))
            .collect();
        assert!(outside.is_empty(), "{outside:02x?}");
    }
    // Strings are memoized, long files are framed, and big lists are batched.
    let used = pickle_opcodes(&pickled).expect("walks");
    for code in [0x94, b'h', b'j', 0x95, b'e', b'u', b'X', 0x86] {
        assert!(used.contains(&code), "{code:#04x} in {used:02x?}");
    }
    assert!(pickle_opcodes(&pickled[..pickled.len() - 1]).is_err());
}

#[test]
fn values_of_2_pow_63_or_more_are_refused() {
    for (field, snapshot) in [
        ("address", {
            let mut snapshot = sample_snapshot(0);
            snapshot.segments[1].blocks[0].address = 1 << 63;
            snapshot
        }),
        ("stream", {
            let mut snapshot = sample_snapshot(0);
            snapshot.device_traces[0][3].stream = u64::MAX;
            snapshot
        }),
    ] {
        for result in [
            write_pickle(&snapshot, Vec::new()),
            write_json(&snapshot, Vec::new()),
        ] {
            match result {
                Err(AllocError::Format { reason, .. }) => {
                    assert!(reason.contains(field), "{reason}");
                    assert!(reason.contains("2^63"), "{reason}");
                }
                other => panic!("expected a format error, got {other:?}"),
            }
        }
    }
    let mut largest = sample_snapshot(0);
    largest.segments[1].blocks[0].address = (1 << 63) - 1;
    let pickled = pickle_bytes(&largest);
    assert_eq!(read_pickle(&pickled[..]).expect("reads"), largest);
}

#[test]
fn truncated_pickles_and_json_are_errors() {
    let snapshot = sample_snapshot(0);
    let pickled = pickle_bytes(&snapshot);
    for len in 0..pickled.len() {
        match read_pickle(&pickled[..len]) {
            Err(AllocError::Format {
                format: "pickle", ..
            }) => {}
            other => panic!("prefix of {len} bytes: {other:?}"),
        }
    }
    let json = json_bytes(&snapshot);
    for len in (0..json.len()).step_by(7) {
        assert!(read_json(&json[..len]).is_err(), "prefix of {len} bytes");
    }
    let vit = std::fs::read(testdata("vit_l16_b8_adam_3steps.pickle")).expect("testdata");
    for len in [0, 1, 2, 11, 1000, 65_547, 700_001, vit.len() - 1] {
        assert!(
            read_pickle(&vit[..len]).is_err(),
            "vit prefix of {len} bytes"
        );
    }
}

#[test]
fn other_files_are_errors() {
    let tsv = std::fs::read(testdata("bert_varlen_adamw_30steps.tsv.gz")).expect("testdata");
    assert!(read_pickle(&tsv[..]).is_err());
    assert!(read_json(&tsv[..]).is_err());
    // pickle.dumps(..., 4) of a class instance, `None`, and bytes.
    let object = b"\x80\x04\x95\x18\x00\x00\x00\x00\x00\x00\x00\x8c\x08__main__\x94\x8c\x04Demo\x94\x93\x94)\x81\x94.";
    let err = read_pickle(&object[..])
        .expect_err("objects are refused")
        .to_string();
    assert!(err.contains("STACK_GLOBAL"), "{err}");
    assert!(read_pickle(&b"\x80\x04N."[..]).is_err());
    let bytes = b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00C\x01x\x94.";
    let err = read_pickle(&bytes[..])
        .expect_err("bytes are refused")
        .to_string();
    assert!(err.contains("SHORT_BINBYTES at offset 11"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_bytes_are_errors(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let with_proto = [&[0x80, 4][..], &bytes].concat();
        prop_assert!(read_pickle(&bytes[..]).is_err());
        prop_assert!(read_pickle(&with_proto[..]).is_err());
        prop_assert!(read_json(&bytes[..]).is_err());
    }

    #[test]
    fn corrupted_pickles_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        let mut pickled = pickle_bytes(&sample_snapshot(3));
        for (idx, byte) in edits {
            let at = idx.index(pickled.len());
            pickled[at] = byte;
        }
        // Either outcome is fine; reaching this line without a panic is the point.
        let _ = read_pickle(&pickled[..]);
    }
}

/// Python's `pickle` and `json` load our files to what PyTorch's own pickle holds, and
/// `pickletools` sees only the viewer's opcodes.
const PYTHON_CHECK: &str = r#"
import json, pickle, pickletools, sys
ours_path, theirs_path, json_path, viewer_hex = sys.argv[1:5]
data = open(ours_path, "rb").read()
viewer = set(bytes.fromhex(viewer_hex))
ops = [op for op, _, _ in pickletools.genops(data)]
assert ops[0].name == "PROTO" and data[1] == 4, ops[0].name
outside = {op.name for op in ops if ord(op.code) not in viewer}
assert not outside, outside
ours = pickle.loads(data)
with open(theirs_path, "rb") as f:
    theirs = pickle.load(f)
assert list(ours) == ["segments", "device_traces", "allocator_settings", "external_annotations"]
assert ours["segments"] == theirs["segments"]
assert ours["allocator_settings"] == theirs["allocator_settings"]
assert ours["external_annotations"] == theirs["external_annotations"]
assert len(ours["device_traces"]) == 1 and len(ours["device_traces"][0]) == 18737
for mine, real in zip(ours["device_traces"][0], theirs["device_traces"][0]):
    assert mine.pop("frames") == []
    assert mine == {key: real[key] for key in mine}, (mine, real)
states = {b["state"] for s in ours["segments"] for b in s["blocks"]}
assert states == {"active_allocated", "inactive"}, states
def as_json(x):
    if isinstance(x, (list, tuple)):
        return [as_json(v) for v in x]
    if isinstance(x, dict):
        return {k: as_json(v) for k, v in x.items()}
    return x
with open(json_path) as f:
    assert json.load(f) == as_json(pickle.loads(data))
print("python agrees")
"#;

#[test]
fn python_reads_our_files() {
    let snapshot = read_vit();
    let dir = std::env::temp_dir();
    let pickle_path = dir.join(format!("snapshot_formats_{}.pickle", std::process::id()));
    let json_path = dir.join(format!("snapshot_formats_{}.json", std::process::id()));
    std::fs::write(&pickle_path, pickle_bytes(&snapshot)).expect("temp file");
    std::fs::write(&json_path, json_bytes(&snapshot)).expect("temp file");
    let viewer_hex: String = VIEWER_OPCODES
        .iter()
        .map(|code| format!("{code:02x}"))
        .collect();
    let output = Command::new("python3")
        .arg("-c")
        .arg(PYTHON_CHECK)
        .arg(&pickle_path)
        .arg(testdata("vit_l16_b8_adam_3steps.pickle"))
        .arg(&json_path)
        .arg(viewer_hex)
        .output();
    let _ = std::fs::remove_file(&pickle_path);
    let _ = std::fs::remove_file(&json_path);
    match output {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            headroom_testkit::gpu::skip("python3 is not on PATH");
        }
        Err(err) => panic!("running python3: {err}"),
        Ok(output) => {
            let stdout = String::from_utf8_lossy(&output.stdout);
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(
                output.status.success(),
                "python3 failed:\n{stdout}\n{stderr}"
            );
            assert_eq!(stdout.trim(), "python agrees");
        }
    }
}

#[test]
fn reads_the_gzipped_bert_trace() {
    let file = std::fs::File::open(testdata("bert_varlen_adamw_30steps.tsv.gz")).expect("testdata");
    let events = read_trace_tsv(file).expect("reads");
    assert_eq!(events.len(), 95_164);
    let mut counts: HashMap<TraceAction, usize> = HashMap::new();
    for event in &events {
        *counts.entry(event.action).or_default() += 1;
    }
    let expected_counts = HashMap::from([
        (TraceAction::Alloc, 32_079),
        (TraceAction::FreeRequested, 31_468),
        (TraceAction::FreeCompleted, 31_468),
        (TraceAction::SegmentAlloc, 149),
    ]);
    assert_eq!(counts, expected_counts);
    assert!(events.iter().all(|event| event.stream == 0));
    let event = |action, addr, size| TraceEvent {
        action,
        addr,
        size,
        stream: 0,
    };
    assert_eq!(
        events[..2],
        [
            event(TraceAction::SegmentAlloc, 140_068_714_971_136, 94_371_840),
            event(TraceAction::Alloc, 140_068_714_971_136, 93_763_584),
        ]
    );
    assert_eq!(
        events[1000],
        event(TraceAction::FreeCompleted, 140_068_811_433_472, 24)
    );
    assert_eq!(
        events[events.len() - 1],
        event(TraceAction::FreeCompleted, 140_068_810_400_256, 96_768)
    );
    let sum = |action| -> u64 {
        events
            .iter()
            .filter(|event| event.action == action)
            .map(|event| event.size)
            .sum()
    };
    assert_eq!(sum(TraceAction::Alloc), 354_603_935_682);
    // No segment is ever freed, so the segments add up to PyTorch's peak reserved (default
    // settings).
    assert_eq!(sum(TraceAction::SegmentAlloc), 25_608_323_072);
    // The peak of live requests rounded up to 512 bytes, as the trace README states.
    let mut live = HashMap::new();
    let (mut current, mut peak) = (0u64, 0u64);
    for event in &events {
        match event.action {
            TraceAction::Alloc => {
                let rounded = event.size.div_ceil(512) * 512;
                live.insert(event.addr, rounded);
                current += rounded;
                peak = peak.max(current);
            }
            TraceAction::FreeCompleted => current -= live.remove(&event.addr).expect("allocated"),
            _ => {}
        }
    }
    assert_eq!(peak, 14_851_701_760);
}
