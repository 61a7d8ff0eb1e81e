//! The replay report as JSON (the crate has no serde: a flat object written by hand).

use super::ReplayReport;

impl ReplayReport {
    /// The report as one JSON object (the sampled series included with `with_series`, as
    /// `series`: `[op, requested, allocated, reserved]` rows).
    pub fn to_json(&self, with_series: bool) -> String {
        use core::fmt::Write;
        let ratio = |r: Option<f64>| r.map_or("null".to_string(), |v| format!("{v:.6}"));
        let mut o = String::with_capacity(1024);
        let _ = write!(o, "{{\"backend\":\"{}\"", self.backend);
        let counts: [(&str, u64); 24] = [
            ("trace_events", self.trace_events as u64),
            ("events", self.events as u64),
            ("ops", self.ops),
            ("allocs", self.allocs),
            ("frees", self.frees),
            ("prelude_allocs", self.prelude_allocs),
            ("trace_failures", self.trace_failures),
            ("ooms", self.ooms),
            ("skipped_frees", self.skipped_frees),
            ("skipped_empty", self.skipped_empty),
            ("streams", self.streams as u64),
            ("peak_requested_bytes", self.peak_requested_bytes),
            ("peak_allocated_bytes", self.peak_allocated_bytes),
            ("peak_reserved_bytes", self.peak_reserved_bytes),
            ("device_allocs", self.device_allocs),
            ("device_frees", self.device_frees),
            ("fences", self.fences),
            ("fence_queries", self.fence_queries),
            ("fence_device_waits", self.fence_device_waits),
            ("cache_hits", self.cache_hits),
            ("cache_misses", self.cache_misses),
            ("cross_stream_frees", self.cross_stream_frees),
            ("alloc_retries", self.alloc_retries),
            ("alloc_ns_median", self.alloc_time.median_ns),
        ];
        push_fields(&mut o, &counts);
        let _ = write!(
            o,
            ",\"alloc_ns_mean\":{:.1},\"free_ns_median\":{},\"free_ns_mean\":{:.1}",
            self.alloc_time.mean_ns, self.free_time.median_ns, self.free_time.mean_ns
        );
        let _ = write!(
            o,
            ",\"utilization\":{},\"requested_utilization\":{},\"wall_seconds\":{:.6},\"simulated_wait_us\":{},\"granule_maps\":{},\"granule_unmaps\":{},\"map_calls\":{},\"unmap_calls\":{}",
            ratio(self.utilization),
            ratio(self.requested_utilization),
            self.wall_seconds,
            self.simulated_wait_us,
            self.granule_maps,
            self.granule_unmaps,
            self.map_calls,
            self.unmap_calls
        );
        match self.second_half {
            Some(w) => {
                let _ = write!(o, ",\"second_half\":{{\"driver_calls\":{}", w.calls());
                push_fields(
                    &mut o,
                    &[
                        ("device_allocs", w.device_allocs),
                        ("device_frees", w.device_frees),
                        ("map_calls", w.map_calls),
                        ("unmap_calls", w.unmap_calls),
                        ("granule_maps", w.granule_maps),
                        ("granule_unmaps", w.granule_unmaps),
                        ("worker_unmap_calls", w.worker_unmap_calls),
                    ],
                );
                o.push('}');
            }
            None => o.push_str(",\"second_half\":null"),
        }
        match self.reference {
            Some(r) => {
                let _ = write!(
                    o,
                    ",\"reference\":{{\"peak_reserved_bytes\":{},\"segment_allocs\":{}}}",
                    r.peak_reserved_bytes, r.segment_allocs
                );
            }
            None => o.push_str(",\"reference\":null"),
        }
        match self.at_peak {
            Some(p) => {
                let _ = write!(o, ",\"at_peak\":{{\"events\":{}", p.events);
                p.footprint.json_members(&mut o);
                o.push('}');
            }
            None => o.push_str(",\"at_peak\":null"),
        }
        let _ = write!(
            o,
            ",\"live_at_end\":{},\"released_at_end_bytes\":{},\"reserved_after_empty_cache\":{}",
            self.live_at_end, self.released_at_end_bytes, self.reserved_after_empty_cache
        );
        if with_series {
            o.push_str(",\"series\":[");
            for (n, s) in self.series.iter().enumerate() {
                let sep = if n == 0 { "" } else { "," };
                let _ = write!(
                    o,
                    "{sep}[{},{},{},{}]",
                    s.op, s.requested_bytes, s.allocated_bytes, s.reserved_bytes
                );
            }
            o.push(']');
        }
        o.push('}');
        o
    }
}

/// Appends `,"key":value` for each field.
fn push_fields(o: &mut String, fields: &[(&str, u64)]) {
    use core::fmt::Write;
    for (k, v) in fields {
        let _ = write!(o, ",\"{k}\":{v}");
    }
}
