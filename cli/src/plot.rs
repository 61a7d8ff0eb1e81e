//! `--plot FILE.png`: requested, allocated and reserved bytes over the trace.
//!
//! Each point of the replay's series is the highest value since the previous point, so a
//! spike between two points still shows. Text is drawn with DejaVu Sans compiled into the
//! binary (plotters' `ab_glyph` backend): no system font is needed.

use crate::replay_cmd::bytes;
use cupool::trace::replay::{ReplayReport, ReplaySample};
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::Path;
use std::sync::Once;

const FONT: &str = "sans-serif";
const SIZE: (u32, u32) = (1280, 720);

fn register_fonts() -> Result<(), String> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        for (style, data) in [
            (FontStyle::Normal, dejavu::sans::regular()),
            (FontStyle::Bold, dejavu::sans::bold()),
        ] {
            if plotters::style::register_font(FONT, style, data).is_err() {
                result = Err("the built-in font cannot be loaded".to_string());
            }
        }
    });
    result
}

/// The unit the y axis counts in: the largest that keeps the top value at 1 or more.
fn unit_for(max: u64) -> (&'static str, f64) {
    [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]
        .into_iter()
        .find(|(_, size)| max >= *size)
        .map_or(("bytes", 1.0), |(unit, size)| (unit, size as f64))
}

/// The series folded into `width` pixel columns: each column's x (its centre, in events)
/// and the highest requested, allocated and reserved bytes of the samples whose interval
/// (from the previous sample's event to its own) overlaps the column. A spike narrower
/// than a pixel still shows, and a short trace draws as steps, not as slopes between
/// points.
fn columns(series: &[ReplaySample], width: usize, x_end: f64) -> Vec<(f64, [u64; 3])> {
    let per_column = x_end / width as f64;
    let mut out = Vec::with_capacity(width);
    let mut first = 0;
    for column in 0..width {
        let (lo, hi) = (column as f64 * per_column, (column + 1) as f64 * per_column);
        while first < series.len() && series[first].op as f64 <= lo {
            first += 1;
        }
        let mut max: Option<[u64; 3]> = None;
        for (j, s) in series.iter().enumerate().skip(first) {
            let start = if j == 0 { 0.0 } else { series[j - 1].op as f64 };
            if start >= hi {
                break;
            }
            let v = [s.requested_bytes, s.allocated_bytes, s.reserved_bytes];
            let m = max.get_or_insert(v);
            for (m, v) in m.iter_mut().zip(v) {
                *m = (*m).max(v);
            }
        }
        if let Some(m) = max {
            out.push((lo + per_column / 2.0, m));
        }
    }
    out
}

pub fn draw(path: &Path, trace_name: &str, r: &ReplayReport) -> Result<(), String> {
    register_fonts()?;
    let reference = r
        .reference
        .map(|x| x.peak_reserved_bytes)
        .filter(|&b| b > 0);
    let top = r.peak_reserved_bytes.max(reference.unwrap_or(0)).max(1);
    let (unit, scale) = unit_for(top);
    let x_end = r.series.last().map_or(1, |s| s.op).max(1) as f64;
    // Head room above the highest line for the legend.
    let y_end = top as f64 / scale * 1.3;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let title = match r.utilization {
        Some(u) => format!(
            "{trace_name}: utilization {:.1}% (peak allocated / peak reserved)",
            u * 100.0
        ),
        None => format!("{trace_name}: nothing reserved"),
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 26).into_font().style(FontStyle::Bold))
        .margin(24)
        .x_label_area_size(56)
        .y_label_area_size(84)
        .build_cartesian_2d(0f64..x_end, 0f64..y_end)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(format!(
            "trace event ({} events, {} backend)",
            r.events, r.backend
        ))
        .y_desc(format!("bytes ({unit})"))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.1}"))
        .label_style((FONT, 16))
        .axis_desc_style((FONT, 18))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.12))
        .draw()
        .map_err(|e| err(&e))?;
    // One point per pixel column, with the highest values of the samples it covers: a
    // spike narrower than a pixel still shows, and lines one pixel wide do not overshoot
    // at sharp spikes (miter joins of wider strokes do).
    let width = chart.plotting_area().dim_in_pixel().0.max(2) as usize;
    let points = columns(&r.series, width, x_end);
    let allocated = RGBColor(95, 158, 214);
    chart
        .draw_series(
            points.iter().map(|&(x, [_, a, _])| {
                PathElement::new([(x, 0.0), (x, a as f64 / scale)], allocated)
            }),
        )
        .map_err(|e| err(&e))?
        .label(format!(
            "allocated (peak {})",
            bytes(r.peak_allocated_bytes)
        ))
        .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 24, y + 6)], allocated.filled()));
    let lines = [
        (
            "requested",
            r.peak_requested_bytes,
            RGBColor(20, 110, 20),
            0,
        ),
        ("reserved", r.peak_reserved_bytes, RGBColor(214, 39, 40), 2),
    ];
    for (name, peak, color, level) in lines {
        let line = points.iter().map(|&(x, v)| (x, v[level] as f64 / scale));
        chart
            .draw_series(LineSeries::new(line, color.stroke_width(1)))
            .map_err(|e| err(&e))?
            .label(format!("{name} (peak {})", bytes(peak)))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], color.stroke_width(3)));
    }
    if let Some(reference) = reference {
        let y = reference as f64 / scale;
        let gray = RGBColor(90, 90, 90);
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, y), (x_end, y)],
                10,
                6,
                gray.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(format!(
                "traced program's own allocator, reserved at peak ({})",
                bytes(reference)
            ))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], gray.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(op: usize, v: u64) -> ReplaySample {
        ReplaySample {
            op,
            requested_bytes: v,
            allocated_bytes: v + 1,
            reserved_bytes: v + 2,
        }
    }

    #[test]
    fn columns_keep_the_highest_sample() {
        let series: Vec<_> = (1..=10)
            .map(|i| sample(i, if i == 3 { 100 } else { i as u64 }))
            .collect();
        let cols = columns(&series, 2, 10.0);
        assert_eq!(cols.len(), 2);
        assert_eq!(cols[0], (2.5, [100, 101, 102]));
        assert_eq!(cols[1], (7.5, [10, 11, 12]));
    }

    #[test]
    fn columns_of_a_short_trace_are_steps() {
        let cols = columns(&[sample(2, 7), sample(10, 3)], 5, 10.0);
        let values: Vec<u64> = cols.iter().map(|c| c.1[0]).collect();
        assert_eq!(values, [7, 3, 3, 3, 3]);
        assert_eq!(cols[0].0, 1.0);
    }
}
