//! Tests of the allocator settings: parsing, the builder, rounding, the snapshot's settings
//! dict and the environment variable, against PyTorch's behaviour.
//!
//! They sit on the config module and its submodules, and go through the config's own API except
//! where a private step is the thing under test (the environment value, the next division).

use super::alloc_conf::from_env_value;
use super::rounding::roundup_power2_next_division;

use super::*;

const MIB: u64 = 1 << 20;

fn parse_ok(conf: &str) -> AllocatorConfig {
    match AllocatorConfig::parse(conf) {
        Ok(config) => config,
        Err(error) => panic!("`{conf}` should parse: {error}"),
    }
}

/// The key of the `InvalidConfig` error `conf` gives, or a description of what it gave.
fn error_key(conf: &str) -> String {
    match AllocatorConfig::parse(conf) {
        Err(AllocError::InvalidConfig { key, .. }) => key,
        Err(other) => format!("other error: {other}"),
        Ok(config) => format!("parsed: {config:?}"),
    }
}

fn with_divisions(divisions: [u64; ROUNDUP_INTERVALS]) -> AllocatorConfig {
    AllocatorConfig {
        roundup_power2_divisions: divisions,
        ..AllocatorConfig::default()
    }
}

#[test]
fn empty_string_gives_defaults() {
    assert_eq!(parse_ok(""), AllocatorConfig::default());
    assert_eq!(
        parse_ok("  "),
        AllocatorConfig {
            raw: "  ".into(),
            ..AllocatorConfig::default()
        }
    );
    assert!(AllocatorConfig::default().expandable_segments);
}

#[test]
fn parses_every_option() {
    let conf = " max_split_size_mb : 128 , max_non_split_rounding_mb:64,\
                roundup_power2_divisions:4, garbage_collection_threshold:0.6,\
                per_process_memory_fraction:0.5,expandable_segments:False,\
                large_segment_size_mb:12,expandable_page_size_mb:20,reclaim_free_pages:False,\
                expandable_handle_size_mb:40,reclaim_settles:False,backend:native,caching:False,";
    let config = parse_ok(conf);
    assert_eq!(
        config,
        AllocatorConfig {
            max_split_size: Some(128 * MIB),
            max_non_split_rounding: 64 * MIB,
            roundup_power2_divisions: [4; ROUNDUP_INTERVALS],
            garbage_collection_threshold: Some(0.6),
            per_process_memory_fraction: Some(0.5),
            expandable_segments: false,
            large_segment_size: 12 * MIB,
            expandable_page_size: 20 * MIB,
            expandable_handle_size: 40 * MIB,
            reclaim_free_pages: false,
            reclaim_settles: false,
            caching: false,
            raw: conf.to_owned(),
        }
    );
    assert!(parse_ok("expandable_segments:true").expandable_segments);
    assert!(parse_ok("expandable_segments:True").expandable_segments);
    assert!(!parse_ok("expandable_segments:false").expandable_segments);
    assert!(parse_ok("reclaim_free_pages:true").reclaim_free_pages);
    assert!(!parse_ok("reclaim_free_pages:false").reclaim_free_pages);
    assert!(parse_ok("reclaim_settles:True").reclaim_settles);
    assert!(!parse_ok("reclaim_settles:false").reclaim_settles);
    assert_eq!(
        parse_ok("reclaim_settles:False"),
        AllocatorConfig {
            raw: "reclaim_settles:False".to_owned(),
            ..AllocatorConfig::reclaiming()
        }
    );
    assert_eq!(
        parse_ok("per_process_memory_fraction:1").per_process_memory_fraction,
        Some(1.0)
    );
    assert_eq!(
        parse_ok("max_split_size_mb:20").max_split_size,
        Some(20 * MIB)
    );
    // A key given twice takes its last value, as in PyTorch.
    assert_eq!(
        parse_ok("max_split_size_mb:40,max_split_size_mb:30").max_split_size,
        Some(30 * MIB)
    );
}

#[test]
fn ignored_pytorch_keys_are_accepted() {
    let conf = "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,\
                pinned_num_register_threads:8,pinned_use_background_threads:True,\
                graph_capture_record_stream_reuse:True,throw_on_cudamalloc_oom:True";
    assert_eq!(
        parse_ok(conf),
        AllocatorConfig {
            raw: conf.to_owned(),
            ..AllocatorConfig::default()
        }
    );
}

#[test]
fn invalid_values_name_their_key() {
    let cases = [
        ("max_split_size_mb:19", "max_split_size_mb"),
        ("max_split_size_mb:-5", "max_split_size_mb"),
        ("max_split_size_mb:20.5", "max_split_size_mb"),
        (
            "max_split_size_mb:99999999999999999999",
            "max_split_size_mb",
        ),
        (
            "max_split_size_mb:18446744073709551615",
            "max_split_size_mb",
        ),
        (
            "max_split_size_mb:30,large_segment_size_mb:40",
            "max_split_size_mb",
        ),
        ("max_non_split_rounding_mb:10", "max_non_split_rounding_mb"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        ("roundup_power2_divisions:0", "roundup_power2_divisions"),
        (
            "roundup_power2_divisions:[256:3]",
            "roundup_power2_divisions",
        ),
        (
            "roundup_power2_divisions:[300:2]",
            "roundup_power2_divisions",
        ),
        ("roundup_power2_divisions:[0:2]", "roundup_power2_divisions"),
        (
            "roundup_power2_divisions:[256:2",
            "roundup_power2_divisions",
        ),
        ("roundup_power2_divisions:[256]", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[x:2]", "roundup_power2_divisions"),
        (
            "garbage_collection_threshold:0",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:1",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:NaN",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:high",
            "garbage_collection_threshold",
        ),
        (
            "per_process_memory_fraction:0",
            "per_process_memory_fraction",
        ),
        (
            "per_process_memory_fraction:1.01",
            "per_process_memory_fraction",
        ),
        ("expandable_segments:yes", "expandable_segments"),
        ("expandable_segments:", "expandable_segments"),
        ("large_segment_size_mb:8", "large_segment_size_mb"),
        ("large_segment_size_mb:21", "large_segment_size_mb"),
        ("expandable_page_size_mb:0", "expandable_page_size_mb"),
        ("expandable_page_size_mb:3", "expandable_page_size_mb"),
        ("expandable_handle_size_mb:0", "expandable_handle_size_mb"),
        ("expandable_handle_size_mb:33", "expandable_handle_size_mb"),
        // Above 1 TiB: these used to pass and overflow the policy's round-ups.
        ("large_segment_size_mb:1048578", "large_segment_size_mb"),
        (
            "expandable_page_size_mb:17592186044414",
            "expandable_page_size_mb",
        ),
        (
            "expandable_handle_size_mb:1048578",
            "expandable_handle_size_mb",
        ),
        (
            "expandable_page_size_mb:17592186044416",
            "expandable_page_size_mb",
        ),
        ("reclaim_free_pages:maybe", "reclaim_free_pages"),
        ("reclaim_settles:1", "reclaim_settles"),
        ("backend:cudaMallocAsync", "backend"),
        ("backend:other", "backend"),
        ("expandable_segments", "expandable_segments"),
        ("max_split_size_mb:128,no_such_option:1", "no_such_option"),
    ];
    for (conf, key) in cases {
        assert_eq!(error_key(conf), key, "parsing `{conf}`");
    }
}

#[test]
fn error_messages_explain() {
    let Err(error) = AllocatorConfig::parse("backend:cudaMallocAsync") else {
        panic!("cudaMallocAsync must be refused");
    };
    assert_eq!(
        error.to_string(),
        "invalid allocator setting `backend`: cudaMallocAsync is not supported; Headroom has \
         only its own caching allocator (`native`)"
    );
    let Err(error) = AllocatorConfig::parse("max_split_size_mb:10") else {
        panic!("10 MiB is below the minimum");
    };
    assert_eq!(
        error.to_string(),
        "invalid allocator setting `max_split_size_mb`: must be at least 20 MiB, got 10 MiB"
    );
}

#[test]
fn roundup_list_follows_pytorch() {
    // The first key also fills the intervals below it; `>` fills those after the last key.
    assert_eq!(
        parse_ok("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions,
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8]
    );
    // Gaps between keys keep 0, as in PyTorch.
    assert_eq!(
        parse_ok("roundup_power2_divisions:[ 2 : 4 , 64:2 ]").roundup_power2_divisions,
        [4, 4, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    // `>` first fills from interval 1 on, then the first key fills below itself.
    assert_eq!(
        parse_ok("roundup_power2_divisions:[>:8,4:2]").roundup_power2_divisions,
        [2, 2, 2, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]
    );
    // Keys beyond 32 GiB clamp to the last interval; 1 MiB is the first.
    assert_eq!(
        parse_ok("roundup_power2_divisions:[1:16,65536:2]").roundup_power2_divisions,
        [16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]
    );
    assert_eq!(
        parse_ok("roundup_power2_divisions:[1:0]").roundup_power2_divisions,
        [0; 16]
    );
    // Commas inside the list do not end the option.
    let config = parse_ok("roundup_power2_divisions:[256:1,>:4],expandable_segments:False");
    assert!(!config.expandable_segments);
    assert_eq!(config.roundup_power2_divisions[9], 4);
}

#[test]
fn conf_string_round_trips() {
    let configs = [
        AllocatorConfig::default(),
        AllocatorConfig::pytorch_defaults(),
        AllocatorConfig::pytorch_expandable(),
        parse_ok("max_split_size_mb:512,garbage_collection_threshold:0.8,per_process_memory_fraction:0.3333333333333333"),
        parse_ok("roundup_power2_divisions:[256:1,512:2,1024:4,>:8],large_segment_size_mb:32"),
        parse_ok("roundup_power2_divisions:[2:4,64:2]"),
        parse_ok("roundup_power2_divisions:2,max_non_split_rounding_mb:100"),
    ];
    for config in configs {
        let conf = config.to_conf_string();
        let back = parse_ok(&conf);
        assert_eq!(back.raw, conf);
        assert_eq!(
            AllocatorConfig {
                raw: String::new(),
                ..back
            },
            AllocatorConfig {
                raw: String::new(),
                ..config
            },
            "{conf}"
        );
    }
    assert_eq!(
        AllocatorConfig::default().to_conf_string(),
        "max_non_split_rounding_mb:20,expandable_segments:True,large_segment_size_mb:20,\
         expandable_page_size_mb:2,expandable_handle_size_mb:2,reclaim_free_pages:True,\
         reclaim_settles:True"
    );
    assert_eq!(
        parse_ok("expandable_segments:True,expandable_page_size_mb:20,reclaim_free_pages:False"),
        AllocatorConfig {
            raw: "expandable_segments:True,expandable_page_size_mb:20,reclaim_free_pages:False"
                .to_owned(),
            ..AllocatorConfig::pytorch_expandable()
        }
    );
}

#[test]
fn builder_matches_parse() {
    let built = AllocatorConfig::builder()
        .max_split_size_mb(128)
        .max_non_split_rounding_mb(64)
        .roundup_power2_divisions(4)
        .garbage_collection_threshold(0.6)
        .per_process_memory_fraction(0.5)
        .expandable_segments(false)
        .large_segment_size_mb(12)
        .expandable_page_size_mb(20)
        .expandable_handle_size_mb(40)
        .reclaim_free_pages(false)
        .reclaim_settles(false)
        .build();
    let built = match built {
        Ok(config) => config,
        Err(error) => panic!("{error}"),
    };
    let parsed = parse_ok(&built.raw);
    assert_eq!(built, parsed);
    assert_eq!(built.max_split_size, Some(128 * MIB));

    let per_interval = [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8];
    let built = AllocatorConfig::builder()
        .roundup_power2_divisions_per_interval(per_interval)
        .build();
    assert_eq!(
        built.ok().map(|c| c.roundup_power2_divisions),
        Some(per_interval)
    );
}

#[test]
fn builder_applies_the_same_validation() {
    let cases = [
        (
            AllocatorConfig::builder().max_split_size_mb(19),
            "max_split_size_mb",
        ),
        (
            AllocatorConfig::builder().max_split_size_mb(u64::MAX),
            "max_split_size_mb",
        ),
        (
            AllocatorConfig::builder().max_non_split_rounding_mb(1),
            "max_non_split_rounding_mb",
        ),
        (
            AllocatorConfig::builder().roundup_power2_divisions(6),
            "roundup_power2_divisions",
        ),
        (
            AllocatorConfig::builder().garbage_collection_threshold(1.5),
            "garbage_collection_threshold",
        ),
        (
            AllocatorConfig::builder().garbage_collection_threshold(f64::NAN),
            "garbage_collection_threshold",
        ),
        (
            AllocatorConfig::builder().per_process_memory_fraction(0.0),
            "per_process_memory_fraction",
        ),
        (
            AllocatorConfig::builder().large_segment_size_mb(3),
            "large_segment_size_mb",
        ),
        (
            AllocatorConfig::builder().large_segment_size_mb(u64::MAX),
            "large_segment_size_mb",
        ),
        (
            AllocatorConfig::builder().expandable_page_size_mb(5),
            "expandable_page_size_mb",
        ),
        (
            AllocatorConfig::builder().expandable_handle_size_mb(3),
            "expandable_handle_size_mb",
        ),
    ];
    for (builder, expected_key) in cases {
        match builder.build() {
            Err(AllocError::InvalidConfig { key, .. }) => assert_eq!(key, expected_key),
            other => panic!("expected an error for {expected_key}, got {other:?}"),
        }
    }
    // 0 (off) is allowed for all intervals from the builder.
    assert!(AllocatorConfig::builder()
        .roundup_power2_divisions(0)
        .build()
        .is_ok());
}

#[test]
fn round_size_without_divisions() {
    let config = AllocatorConfig::default();
    let cases = [
        (0, 512),
        (1, 512),
        (511, 512),
        (512, 512),
        (513, 1024),
        (1200, 1536),
        (1048575, 1048576),
        (10485761, 10486272),
        (26214401, 26214912),
        (u64::MAX - 511, u64::MAX - 511),
        (u64::MAX - 510, u64::MAX),
        (u64::MAX, u64::MAX),
    ];
    for (size, expected) in cases {
        assert_eq!(config.round_size(size), expected, "round_size({size})");
    }
}

#[test]
fn round_size_with_power2_divisions() {
    let config = with_divisions([4; ROUNDUP_INTERVALS]);
    let cases = [
        // At most 512·4 bytes: plain 512-byte rounding.
        (1200, 1536),
        (2048, 2048),
        // Above: quarters of the power-of-two interval.
        (2049, 2560),
        (3000, 3072),
        (4097, 5120),
        (1 << 20, 1 << 20),
        ((1 << 20) + 1, 1280 << 10),
        (5 * MIB, 5 * MIB),
        (5 * MIB + 1, 6 * MIB),
        (7 * MIB + 1, 8 * MIB),
        (8 * MIB, 8 * MIB),
        (1 << 40, 1 << 40),
        ((1 << 40) + 1, (5 << 40) / 4),
        ((1u64 << 63) + 1, (1u64 << 63) + (1u64 << 61)),
        (u64::MAX, u64::MAX),
    ];
    for (size, expected) in cases {
        assert_eq!(config.round_size(size), expected, "round_size({size})");
    }
}

#[test]
fn round_size_uses_the_interval_of_the_size() {
    // 2 divisions from 64 MiB up, none below (PyTorch's `[32:1,>:2]`).
    let config = parse_ok("roundup_power2_divisions:[32:1,>:2]");
    assert_eq!(config.round_size(40 * MIB + 1), 40 * MIB + 512);
    assert_eq!(config.round_size(65 * MIB), 96 * MIB);
    assert_eq!(config.round_size(100 * MIB), 128 * MIB);
    // Sizes below 2 MiB all use interval 0.
    let config = parse_ok("roundup_power2_divisions:[1:8]");
    assert_eq!(config.round_size(1000 * 1024 + 1), 1024 * 1024);
    assert_eq!(config.round_size(3 * MIB + 1), 3 * MIB + 512);
    // Divisions too fine for the interval fall back on the next power of two.
    let config = with_divisions([1 << 40; ROUNDUP_INTERVALS]);
    assert_eq!(config.round_size(3 * MIB), 3 * MIB);
    assert_eq!(roundup_power2_next_division(3 * MIB, 1 << 40), 4 * MIB);
}

#[test]
fn allocator_settings_as_pytorch_reports_them() {
    let config = parse_ok("max_split_size_mb:256,roundup_power2_divisions:[256:1,>:4]");
    let settings = config.allocator_settings();
    let keys: Vec<&str> = settings.iter().map(|(key, _)| key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "PYTORCH_CUDA_ALLOC_CONF",
            "max_split_size",
            "garbage_collection_threshold",
            "expandable_segments",
            "pinned_num_register_threads",
            "release_lock_on_cudamalloc",
            "pinned_use_cuda_host_register",
            "roundup_power2_divisions",
        ]
    );
    assert_eq!(settings[0].1, Value::Str(config.raw.clone()));
    assert_eq!(settings[1].1, Value::Int(256 << 20));
    assert_eq!(settings[2].1, Value::Float(0.0));
    assert_eq!(settings[3].1, Value::Bool(true));
    assert_eq!(settings[4].1, Value::Int(1));
    assert_eq!(settings[5].1, Value::Bool(false));
    assert_eq!(settings[6].1, Value::Bool(false));
    let Value::Dict(roundup) = &settings[7].1 else {
        panic!("roundup_power2_divisions must be a dict");
    };
    assert_eq!(roundup.len(), ROUNDUP_INTERVALS);
    assert_eq!(roundup[0], (Value::Str("1".into()), Value::Int(1)));
    assert_eq!(roundup[8], (Value::Str("256".into()), Value::Int(1)));
    assert_eq!(roundup[9], (Value::Str("512".into()), Value::Int(4)));
    assert_eq!(roundup[15], (Value::Str("32768".into()), Value::Int(4)));

    let unlimited = AllocatorConfig::default().allocator_settings();
    assert_eq!(unlimited[1].1, Value::Int(-1));
}

#[test]
fn from_env_reads_headroom_alloc_conf() {
    use std::env::VarError;

    assert_eq!(ALLOC_CONF_ENV, "HEADROOM_ALLOC_CONF");
    let unset = from_env_value(Err(VarError::NotPresent), Err(VarError::NotPresent));
    assert_eq!(unset.ok(), Some(AllocatorConfig::default()));
    let set = from_env_value(
        Ok("expandable_segments:False".to_owned()),
        Err(VarError::NotPresent),
    );
    let expected = AllocatorConfig {
        raw: "expandable_segments:False".into(),
        ..AllocatorConfig::pytorch_defaults()
    };
    assert_eq!(set.ok(), Some(expected));
    let bogus = from_env_value(Ok("bogus:1".to_owned()), Err(VarError::NotPresent));
    assert!(matches!(bogus, Err(AllocError::InvalidConfig { key, .. }) if key == "bogus"));
    let not_unicode = from_env_value(
        Err(VarError::NotUnicode("\u{fffd}".into())),
        Err(VarError::NotPresent),
    );
    assert!(
        matches!(not_unicode, Err(AllocError::InvalidConfig { key, .. }) if key == ALLOC_CONF_ENV)
    );
}

#[test]
fn the_no_caching_variable_turns_caching_off() {
    use std::env::VarError;

    assert_eq!(NO_CACHING_ENV, "HEADROOM_NO_CUDA_MEMORY_CACHING");
    let off = from_env_value(Err(VarError::NotPresent), Ok("1".to_owned())).unwrap();
    assert!(!off.caching());
    assert_eq!(off.raw(), "caching:False");
    assert_eq!(off, AllocatorConfig::parse("caching:False").unwrap());
    let with_conf = from_env_value(
        Ok("expandable_segments:False".to_owned()),
        Ok("1".to_owned()),
    )
    .unwrap();
    assert_eq!(with_conf.raw(), "expandable_segments:False,caching:False");
    assert!(!with_conf.caching() && !with_conf.expandable_segments());
    for kept in ["0", ""] {
        let on = from_env_value(Err(VarError::NotPresent), Ok(kept.to_owned())).unwrap();
        assert!(on.caching());
    }
    let bogus = from_env_value(Err(VarError::NotPresent), Ok("yes".to_owned()));
    assert!(
        matches!(bogus, Err(AllocError::InvalidConfig { key, reason }) if key == NO_CACHING_ENV && reason.contains("`yes`"))
    );
    // The builder and the string round-trip the setting.
    let built = AllocatorConfig::builder().caching(false).build().unwrap();
    assert!(!built.caching());
    assert!(built.raw().ends_with(",caching:False"));
    assert_eq!(AllocatorConfig::parse(built.raw()).unwrap().raw, built.raw);
    assert!(!AllocatorConfig::default()
        .to_conf_string()
        .contains("caching"));
}

#[test]
fn a_conf_applies_over_other_defaults() {
    let base = AllocatorConfig::builder()
        .expandable_handle_size_mb(32)
        .build()
        .unwrap();
    let config = base.with_conf("max_split_size_mb:512").unwrap();
    assert_eq!(config.expandable_handle_size(), 32 * MIB);
    assert_eq!(config.max_split_size, Some(512 * MIB));
    assert_eq!(config.raw, "max_split_size_mb:512");
    let back = base.with_conf("expandable_handle_size_mb:2").unwrap();
    assert_eq!(back.expandable_handle_size(), 2 * MIB);
    assert!(matches!(
        base.with_conf("expandable_handle_size_mb:7"),
        Err(AllocError::InvalidConfig { .. })
    ));
    assert_eq!(
        AllocatorConfig::parse("").unwrap(),
        AllocatorConfig::default()
    );
}

/// The largest unit sizes are accepted, and an allocator with them answers a request with a
/// typed out-of-memory error on a small device, not an overflow.
#[test]
fn the_largest_unit_sizes_are_accepted_and_do_not_overflow() {
    use crate::{CachingAllocator, SimulatedStorage, StreamId};

    for conf in [
        "expandable_page_size_mb:1048576,expandable_handle_size_mb:1048576",
        "expandable_segments:False,large_segment_size_mb:1048576",
    ] {
        let config = parse_ok(conf);
        let allocator = CachingAllocator::new(SimulatedStorage::new(1 << 30), config);
        // A small request fits the 2 MiB small pool; 3 MiB needs a 1 TiB page or segment.
        let small = allocator.allocate(1, StreamId::DEFAULT).unwrap();
        allocator.free(small).unwrap();
        for size in [3 << 20, u64::MAX / 2] {
            let outcome = allocator.allocate(size, StreamId::DEFAULT);
            assert!(
                matches!(outcome, Err(crate::AllocError::OutOfMemory(_))),
                "`{conf}`, {size} bytes: {outcome:?}"
            );
        }
    }
}
