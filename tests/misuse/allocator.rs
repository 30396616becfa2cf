//! Misuse of headroom-caching-allocator: settings strings and builder settings out of range or
//! misspelt, allocations past a simulated device, a host capacity or the memory fraction,
//! addresses of another allocator or of a freed block, snapshot and trace files that do not
//! parse. On host memory or a simulated device.

use headroom_caching_allocator::{
    read_json, read_pickle, read_trace_tsv, AllocError, AllocatorConfig, CachingAllocator,
    HostStorage, SimulatedStorage, StreamId,
};

use crate::{expect_eq, expect_err, Case, Outcome};
use headroom_testkit::misuse_cases;

pub(crate) fn cases() -> Vec<Case> {
    /// `Ok` when `config` is [`AllocError::InvalidConfig`] of `key`, its message naming `text`.
    fn invalid_config(
        config: Result<AllocatorConfig, AllocError>,
        key: &str,
        text: &str,
    ) -> Outcome {
        expect_err!(
            config,
            AllocError::InvalidConfig { key: k, .. } if k == key,
            naming text
        )
    }
    fn parse_refused(conf: &str, key: &str) -> Outcome {
        invalid_config(AllocatorConfig::parse(conf), key, key)
    }
    fn simulated(capacity: u64, config: AllocatorConfig) -> CachingAllocator<SimulatedStorage> {
        CachingAllocator::new(SimulatedStorage::new(capacity), config)
    }
    misuse_cases![
        conf_with_a_misspelt_key_is_invalid_config_naming_it =>
            parse_refused("max_split_sise_mb:64", "max_split_sise_mb"),
        conf_max_split_size_below_20_mib_is_invalid_config =>
            parse_refused("max_split_size_mb:10", "max_split_size_mb"),
        conf_expandable_page_size_above_1_tib_is_invalid_config =>
            parse_refused("expandable_page_size_mb:1048578", "expandable_page_size_mb"),
        conf_fractional_mib_is_invalid_config =>
            parse_refused("max_split_size_mb:20.5", "max_split_size_mb"),
        conf_key_without_a_value_is_invalid_config =>
            parse_refused("expandable_segments:", "expandable_segments"),
        conf_item_without_a_colon_is_invalid_config =>
            parse_refused("expandable_segments", "expandable_segments"),
        conf_cuda_malloc_async_backend_is_invalid_config =>
            parse_refused("backend:cudaMallocAsync", "backend"),
        conf_roundup_divisions_of_3_is_invalid_config =>
            parse_refused("roundup_power2_divisions:3", "roundup_power2_divisions"),
        conf_garbage_collection_threshold_of_1_is_invalid_config => {
            parse_refused(
                "garbage_collection_threshold:1.0",
                "garbage_collection_threshold",
            )
        },
        conf_mib_count_overflowing_u64_bytes_is_invalid_config => {
            parse_refused(
                "large_segment_size_mb:18446744073709551615",
                "large_segment_size_mb",
            )
        },
        conf_boolean_that_is_not_true_or_false_is_invalid_config =>
            parse_refused("expandable_segments:maybe", "expandable_segments"),
        builder_handle_size_above_1_tib_is_invalid_config => invalid_config(
            AllocatorConfig::builder().expandable_handle_size_mb(1_048_578).build(),
            "expandable_handle_size_mb",
            "expandable_handle_size_mb",
        ),
        builder_mib_count_overflowing_u64_bytes_is_invalid_config => invalid_config(
            AllocatorConfig::builder().max_split_size_mb(u64::MAX).build(),
            "max_split_size_mb",
            "too large",
        ),
        builder_nan_memory_fraction_is_invalid_config => invalid_config(
            AllocatorConfig::builder().per_process_memory_fraction(f64::NAN).build(),
            "per_process_memory_fraction",
            "per_process_memory_fraction",
        ),
        builder_odd_large_segment_size_is_invalid_config => invalid_config(
            AllocatorConfig::builder().large_segment_size_mb(21).build(),
            "large_segment_size_mb",
            "21 MiB",
        ),
        allocating_past_a_simulated_device_is_out_of_memory_with_its_report => {
            let allocator = simulated(64 << 20, AllocatorConfig::pytorch_defaults());
            let held = allocator.allocate(30 << 20, StreamId::DEFAULT)?;
            let res = expect_err!(
                allocator.allocate(100 << 20, StreamId::DEFAULT),
                AllocError::OutOfMemory(report)
                    if report.requested == 100 << 20
                        && report.capacity == 64 << 20
                        && report.allocated == 30 << 20
                        && report.storage == "simulated",
                naming "tried to allocate 100.00 MiB"
            );
            allocator.free(held)?;
            res
        },
        allocating_u64_max_bytes_is_out_of_memory => {
            let allocator = simulated(64 << 20, AllocatorConfig::default());
            expect_err!(
                allocator.allocate(u64::MAX, StreamId::DEFAULT),
                AllocError::OutOfMemory(report) if report.requested == u64::MAX
            )
        },
        allocating_past_the_memory_fraction_is_out_of_memory_naming_the_limit => {
            let config = AllocatorConfig::builder()
                .per_process_memory_fraction(0.5)
                .expandable_segments(false)
                .build()?;
            let allocator = simulated(100 << 20, config);
            expect_err!(
                allocator.allocate(60 << 20, StreamId::DEFAULT),
                AllocError::OutOfMemory(report) if report.allowed == Some(50 << 20)
            )
        },
        allocating_past_a_host_capacity_is_out_of_memory_of_the_host => {
            let allocator = CachingAllocator::new(
                HostStorage::with_capacity(1 << 20),
                AllocatorConfig::default(),
            );
            expect_err!(
                allocator.allocate(4 << 20, StreamId::DEFAULT),
                AllocError::OutOfMemory(report) if report.storage == "host"
            )
        },
        freeing_another_allocators_block_is_unknown_address => {
            let (ours, theirs) = (
                simulated(64 << 20, AllocatorConfig::default()),
                simulated(64 << 20, AllocatorConfig::default()),
            );
            let block = theirs.allocate(4096, StreamId::DEFAULT)?;
            let address = block.address();
            let res = expect_err!(
                ours.free(block),
                AllocError::UnknownAddress { address: a } if *a == address
            );
            // The block was refused, not freed: `theirs` still counts it.
            res.and_then(|()| expect_eq(theirs.memory_allocated(), 4096))
        },
        record_stream_of_another_allocators_block_is_unknown_address => {
            let (ours, theirs) = (
                simulated(64 << 20, AllocatorConfig::default()),
                simulated(64 << 20, AllocatorConfig::default()),
            );
            let block = theirs.allocate(4096, StreamId::DEFAULT)?;
            let res = expect_err!(
                ours.record_stream(&block, StreamId(7)),
                AllocError::UnknownAddress { .. }
            );
            theirs.free(block)?;
            res
        },
        record_stream_at_an_address_never_handed_out_is_unknown_address => {
            let allocator = simulated(64 << 20, AllocatorConfig::default());
            expect_err!(
                allocator.record_stream_address(0x1234, StreamId(1)),
                AllocError::UnknownAddress { address: 0x1234 },
                naming "0x1234"
            )
        },
        allocation_stream_of_a_freed_block_is_unknown_address => {
            let allocator = simulated(64 << 20, AllocatorConfig::default());
            let block = allocator.allocate(512, StreamId(3))?;
            let address = block.address();
            allocator.free(block)?;
            expect_err!(
                allocator.allocation_stream(address),
                AllocError::UnknownAddress { .. }
            )
        },
        pickle_of_garbage_bytes_is_a_pickle_format_error => {
            expect_err!(
                read_pickle(&b"\x80\x04not a pickle at all"[..]),
                AllocError::Format {
                    format: "pickle",
                    ..
                }
            )
        },
        json_snapshot_of_garbage_is_a_json_format_error => {
            expect_err!(
                read_json(&b"{\"segments\": 7"[..]),
                AllocError::Format { format: "json", .. }
            )
        },
        trace_tsv_with_an_unknown_action_is_a_trace_format_error => {
            expect_err!(
                read_trace_tsv(&b"action\taddr\tsize\nteleport\t16\t512\n"[..]),
                AllocError::Format { format: "trace", .. },
                naming "teleport"
            )
        },
        trace_tsv_without_an_action_column_is_a_trace_format_error => {
            expect_err!(
                read_trace_tsv(&b"addr\tsize\n16\t512\n"[..]),
                AllocError::Format { format: "trace", .. },
                naming "action"
            )
        },
        conf_roundup_list_without_its_closing_bracket_is_invalid_config => {
            parse_refused(
                "roundup_power2_divisions:[256:1,512:2",
                "roundup_power2_divisions",
            )
        },
        conf_roundup_list_with_an_interval_that_is_not_a_power_of_two_is_invalid_config => {
            parse_refused(
                "roundup_power2_divisions:[300:2]",
                "roundup_power2_divisions",
            )
        },
        conf_roundup_list_with_an_interval_past_u64_is_invalid_config => {
            parse_refused(
                "roundup_power2_divisions:[99999999999999999999:2]",
                "roundup_power2_divisions",
            )
        },
        conf_roundup_list_with_an_empty_entry_is_invalid_config =>
            parse_refused("roundup_power2_divisions:[:]", "roundup_power2_divisions"),
        conf_negative_memory_fraction_is_invalid_config => {
            parse_refused(
                "per_process_memory_fraction:-0.5",
                "per_process_memory_fraction",
            )
        },
        conf_infinite_memory_fraction_is_invalid_config => {
            parse_refused(
                "per_process_memory_fraction:inf",
                "per_process_memory_fraction",
            )
        },
        conf_nan_garbage_collection_threshold_is_invalid_config => {
            parse_refused(
                "garbage_collection_threshold:nan",
                "garbage_collection_threshold",
            )
        },
        conf_later_bad_repeat_of_a_key_is_invalid_config => {
            parse_refused(
                "max_split_size_mb:64,max_split_size_mb:10",
                "max_split_size_mb",
            )
        },
        conf_key_of_non_ascii_text_is_invalid_config_naming_it =>
            parse_refused("tamaño_mb:1", "tamaño_mb"),
        pickle_nested_past_the_depth_limit_is_a_pickle_format_error => {
            let mut bytes = b"\x80\x04".to_vec();
            bytes.extend(std::iter::repeat_n(b']', 600));
            bytes.extend(std::iter::repeat_n(b'a', 599));
            bytes.push(b'.');
            expect_err!(
                read_pickle(&bytes[..]),
                AllocError::Format { format: "pickle", .. },
                naming "deeper"
            )
        },
        empty_pickle_is_a_pickle_format_error => {
            expect_err!(
                read_pickle(&b""[..]),
                AllocError::Format {
                    format: "pickle",
                    ..
                }
            )
        },
    ]
}
