//! `bench-memory --html`: one self-contained page (inline SVG and CSS, no script, no external
//! file) with, per model and batch, the traced step's peak split by component for each case, and
//! each case's requested bytes over that step with its phases shaded. A timeline's x axis is time
//! (the history's timestamps) or the order of the allocator's events, chosen by a toggle at the
//! top of the page: each chart holds both layers, and CSS shows one.
//!
//! It reads [`CaseResult`]s only; it runs nothing and knows no device.

use std::fmt::Write as _;

use super::measure::CaseResult;
use super::report::{size, Anchors};
use super::training::Phase;

/// Colours of the peak's components, in [`super::timeline::AtPeak::components`] order.
const COMPONENT_COLOURS: [&str; 8] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#bab0ac",
];

fn phase_colour(phase: Phase) -> &'static str {
    match phase {
        Phase::Forward => "#e8f0fa",
        Phase::Backward => "#fdf0e2",
        Phase::Step => "#fbe6e6",
        Phase::ZeroGrad => "#eeeeee",
    }
}

const WIDTH: f64 = 900.0;
/// Width of one timeline: two fit a row.
const TIMELINE_WIDTH: f64 = 640.0;
const LABEL: f64 = 190.0;
const BAR: f64 = 26.0;

/// The whole page.
pub(crate) fn page(results: &[CaseResult], anchors: &Anchors, title: &str) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title>\n<style>\
         body{{font-family:sans-serif;margin:2em;color:#222}} svg text{{font-size:12px}} \
         h2{{margin-top:2em}} .timelines{{display:grid;grid-template-columns:repeat(2,{TIMELINE_WIDTH}px);\
         gap:8px 24px}} #axis-events:checked~.timelines .by-time{{display:none}} \
         #axis-events:checked~.timelines .by-event{{display:inline}}</style></head><body>\n\
         <h1>{t}</h1>\n<p>Peaks are the traced step's allocated bytes split by what held them \
         at the moment of the peak; the timelines show the allocator's requested bytes after \
         each allocation or free of that step, two cases a row (a case stepped in backward \
         beside the same optimizer stepped after it). Their x axis is time, the host's clock \
         when each allocation or free was made (on a GPU the kernels run later), or the order \
         of the events, where a short phase keeps a visible share of the width:</p>\n\
         <input type=\"radio\" name=\"axis\" id=\"axis-time\" checked>\
         <label for=\"axis-time\">time</label>\n\
         <input type=\"radio\" name=\"axis\" id=\"axis-events\">\
         <label for=\"axis-events\">event order</label>\n",
        t = escape(title)
    );
    let mut groups: Vec<(&str, usize)> = Vec::new();
    for r in results {
        if !groups.contains(&(r.model, r.batch)) {
            groups.push((r.model, r.batch));
        }
    }
    for (model, batch) in groups {
        let group: Vec<&CaseResult> = results
            .iter()
            .filter(|r| r.model == model && r.batch == batch)
            .collect();
        let _ = writeln!(
            out,
            "<h2>{} · batch {batch} · {}</h2>",
            escape(model),
            escape(&group[0].device)
        );
        out.push_str(&peak_bars(&group, anchors));
        let top = group
            .iter()
            .flat_map(|r| r.timeline.bytes.iter().copied())
            .max()
            .unwrap_or(1)
            .max(1);
        out.push_str("<div class=\"timelines\">\n");
        for r in &group {
            out.push_str(&timeline_chart(r, top));
        }
        out.push_str("</div>\n");
    }
    out.push_str("</body></html>\n");
    out
}

/// Stacked horizontal bars of the peak's components, one per case, with PyTorch's peak as a
/// black tick where known.
fn peak_bars(group: &[&CaseResult], anchors: &Anchors) -> String {
    let pytorch = |r: &CaseResult| super::report::anchor(anchors, r).map(|a| a.steady_peak_alloc);
    let top = group
        .iter()
        .map(|r| r.at_peak.total().max(pytorch(r).unwrap_or(0)))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let plot = WIDTH - LABEL - 90.0;
    let height = 40.0 + BAR * 1.4 * group.len() as f64 + 50.0;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\">\n\
         <text x=\"0\" y=\"16\" font-weight=\"bold\">Peak allocated by component</text>\n"
    );
    for (i, r) in group.iter().enumerate() {
        let y = 30.0 + BAR * 1.4 * i as f64;
        let _ = writeln!(
            svg,
            "<text x=\"0\" y=\"{:.1}\">{}</text>",
            y + BAR * 0.7,
            r.case.name()
        );
        let mut x = LABEL;
        for ((name, bytes), colour) in r.at_peak.components().iter().zip(COMPONENT_COLOURS) {
            let w = *bytes as f64 / top * plot;
            if w > 0.0 {
                let _ = writeln!(
                    svg,
                    "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"{BAR}\" \
                     fill=\"{colour}\"><title>{name}: {}</title></rect>",
                    size(*bytes)
                );
            }
            x += w;
        }
        // A language model's loss run alone: its logits' bytes at their peak; pinned host
        // memory where the case used any.
        let logits = r
            .logits_bytes
            .map_or_else(String::new, |bytes| format!(" (logits {})", size(bytes)));
        let host = match r.host_peak_reserved_bytes {
            Some(bytes) if bytes > 0 => format!(" + host {}", size(bytes)),
            _ => String::new(),
        };
        let _ = writeln!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\">{}{logits}{host}</text>",
            x + 4.0,
            y + BAR * 0.7,
            size(r.at_peak.total())
        );
        if let Some(peak) = pytorch(r) {
            let px = LABEL + peak as f64 / top * plot;
            let _ = writeln!(
                svg,
                "<line x1=\"{px:.1}\" x2=\"{px:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#000\" \
                 stroke-width=\"2\"><title>PyTorch: {}</title></line>",
                y - 3.0,
                y + BAR + 3.0,
                size(peak)
            );
        }
    }
    let mut x = 0.0;
    let mut legend_y = height - 28.0;
    for ((name, _), colour) in group[0].at_peak.components().iter().zip(COMPONENT_COLOURS) {
        if x + 16.0 + 7.0 * name.len() as f64 > WIDTH {
            x = 0.0;
            legend_y += 16.0;
        }
        let _ = writeln!(
            svg,
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{colour}\"/>\
             <text x=\"{:.1}\" y=\"{legend_y:.1}\">{}</text>",
            legend_y - 9.0,
            x + 13.0,
            name.replace('_', " ")
        );
        x += 16.0 + 7.0 * name.len() as f64;
    }
    if group.iter().any(|r| pytorch(r).is_some()) {
        if x + 110.0 > WIDTH {
            x = 0.0;
            legend_y += 16.0;
        }
        let _ = writeln!(
            svg,
            "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#000\" \
             stroke-width=\"2\"/><text x=\"{:.1}\" y=\"{legend_y:.1}\">PyTorch peak</text>",
            legend_y - 10.0,
            legend_y + 2.0,
            x + 5.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// The requested bytes over the traced step, phases shaded, the peak marked; `top` scales the
/// y axis alike for every case of a group. Two layers share the y axis: by time (shown unless
/// the page's toggle asks otherwise) and by event order, where each phase spans a width
/// proportional to its events but at least [`MIN_PHASE_SHARE`] of the plot, so a step of two
/// events stays visible.
fn timeline_chart(r: &CaseResult, top: u64) -> String {
    let (w, h, left, top_y, bottom) = (TIMELINE_WIDTH, 180.0, 70.0, 30.0, 22.0);
    let plot_w = w - left - 10.0;
    let plot_h = h - bottom - top_y;
    let timeline = &r.timeline;
    let points = &timeline.bytes;
    let n = points.len().max(2) - 1;
    let y_of = |b: u64| top_y + plot_h - b as f64 / top as f64 * plot_h;
    let span_us = time_span_us(&timeline.time_us);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\">\n\
         <text x=\"0\" y=\"14\" font-weight=\"bold\">{} — requested bytes over the traced step \
         ({} events, {:.1} ms)</text>\n",
        r.case.name(),
        points.len() - 1,
        span_us as f64 / 1e3
    );
    for frac in [0.0, 0.5, 1.0] {
        let bytes = (top as f64 * frac) as u64;
        let _ = writeln!(
            svg,
            "<text x=\"0\" y=\"{:.1}\">{}</text><line x1=\"{left}\" x2=\"{:.1}\" y1=\"{y:.1}\" \
             y2=\"{y:.1}\" stroke=\"#ccc\"/>",
            y_of(bytes) + 4.0,
            size(bytes),
            w - 10.0,
            y = y_of(bytes)
        );
    }
    let by_events = event_axis(&timeline.phase_starts, n, left, plot_w);
    let by_time = time_axis(&timeline.time_us, left, plot_w);
    for axis in [Axis::Time, Axis::Events] {
        let x_of = |i: usize| match axis {
            Axis::Time => by_time(i),
            Axis::Events => by_events(i),
        };
        let _ = writeln!(
            svg,
            "<g class=\"{}\"{}>",
            axis.class(),
            if axis == Axis::Time {
                ""
            } else {
                " display=\"none\""
            }
        );
        // A phase begins with its first event: by time, when that event happened; by event
        // order, at the figure before it.
        let phase_x = |start: usize| match axis {
            Axis::Time => x_of((start + 1).min(n)),
            Axis::Events => x_of(start),
        };
        let starts = &timeline.phase_starts;
        for (k, (start, phase)) in starts.iter().enumerate() {
            let x0 = phase_x(*start);
            let x1 = starts.get(k + 1).map_or(x_of(n), |(s, _)| phase_x(*s));
            let _ = write!(
                svg,
                "<rect x=\"{x0:.1}\" y=\"{top_y}\" width=\"{:.1}\" height=\"{plot_h:.1}\" \
                 fill=\"{}\"><title>{}</title></rect>",
                (x1 - x0).max(0.5),
                phase_colour(*phase),
                phase.label()
            );
            // The label where it fits (a phase of a few microseconds is too narrow by time).
            if x1 - x0 >= 7.0 * phase.label().len() as f64 + 6.0 {
                let _ = write!(
                    svg,
                    "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"#555\">{}</text>",
                    x0 + 3.0,
                    top_y + 12.0,
                    phase.label()
                );
            }
            svg.push('\n');
        }
        let path = match axis {
            // A step: each figure holds until the next event's time.
            Axis::Time => std::iter::once((x_of(0), y_of(points[0])))
                .chain(
                    (1..points.len())
                        .flat_map(|i| [(x_of(i), y_of(points[i - 1])), (x_of(i), y_of(points[i]))]),
                )
                .collect::<Vec<_>>(),
            Axis::Events => (0..points.len())
                .map(|i| (x_of(i), y_of(points[i])))
                .collect(),
        };
        let mut coords = String::new();
        for (x, y) in thin_to_pixels(&path) {
            let _ = write!(coords, "{x:.1},{y:.1} ");
        }
        let _ = writeln!(
            svg,
            "<polyline fill=\"none\" stroke=\"#4e79a7\" stroke-width=\"1.5\" points=\"{}\"/>",
            coords.trim_end()
        );
        let peak = timeline.peak_index;
        let (px, py) = (x_of(peak), y_of(points[peak]));
        let (anchor, dx) = if px > left + plot_w / 2.0 {
            ("end", -7.0)
        } else {
            ("start", 7.0)
        };
        let _ = writeln!(
            svg,
            "<circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"3.5\" fill=\"#e15759\"/><text x=\"{:.1}\" \
             y=\"{:.1}\" text-anchor=\"{anchor}\" fill=\"#e15759\">peak {} ({})</text>",
            px + dx,
            // Below the phase labels when the peak touches the top of the plot.
            if py < top_y + 24.0 {
                py + 30.0
            } else {
                py + 16.0
            },
            size(points[peak]),
            r.at_peak.phase.map_or("-", |p| p.label())
        );
        let (caption, end) = match axis {
            Axis::Time => ("time →", format!("{:.1} ms", span_us as f64 / 1e3)),
            Axis::Events => ("allocator events →", format!("{n}")),
        };
        let _ = writeln!(
            svg,
            "<text x=\"{left}\" y=\"{:.1}\" fill=\"#555\">{caption}</text><text x=\"{:.1}\" \
             y=\"{:.1}\" text-anchor=\"end\" fill=\"#555\">{end}</text>\n</g>",
            h - 4.0,
            w - 10.0,
            h - 4.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// The x axis of a timeline layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Axis {
    /// The history's timestamps, linear.
    Time,
    /// The events' order, piecewise linear per phase.
    Events,
}

impl Axis {
    /// The layer's class, which the page's CSS shows or hides.
    fn class(self) -> &'static str {
        match self {
            Axis::Time => "by-time",
            Axis::Events => "by-event",
        }
    }
}

/// Microseconds from the first timestamp to the last, at least 1.
fn time_span_us(time_us: &[i64]) -> i64 {
    match (time_us.first(), time_us.last()) {
        (Some(first), Some(last)) => (last - first).max(1),
        _ => 1,
    }
}

/// The x coordinate of each figure `0..time_us.len()`: linear in its timestamp, the first at
/// `left` and the last at `left + width`.
fn time_axis(time_us: &[i64], left: f64, width: f64) -> impl Fn(usize) -> f64 + '_ {
    let first = time_us.first().copied().unwrap_or(0);
    let span = time_span_us(time_us) as f64;
    move |i: usize| {
        let t = time_us.get(i).or(time_us.last()).copied().unwrap_or(first);
        left + (t - first).max(0) as f64 / span * width
    }
}

/// Smallest share of the timeline's width a phase gets.
const MIN_PHASE_SHARE: f64 = 0.06;

/// The x coordinate of each event index `0..=n`: piecewise linear, one piece per phase.
fn event_axis(
    phase_starts: &[(usize, Phase)],
    n: usize,
    left: f64,
    width: f64,
) -> impl Fn(usize) -> f64 {
    let mut bounds: Vec<usize> = phase_starts.iter().map(|(s, _)| *s).collect();
    if bounds.first() != Some(&0) {
        bounds.insert(0, 0);
    }
    bounds.push(n);
    bounds.dedup();
    let weights: Vec<f64> = bounds
        .windows(2)
        .map(|w| ((w[1] - w[0]) as f64 / n.max(1) as f64).max(MIN_PHASE_SHARE))
        .collect();
    let total: f64 = weights.iter().sum::<f64>().max(f64::MIN_POSITIVE);
    let mut edges = vec![left];
    for weight in &weights {
        edges.push(edges[edges.len() - 1] + weight / total * width);
    }
    move |i: usize| {
        let k = bounds
            .partition_point(|b| *b <= i)
            .clamp(1, bounds.len() - 1)
            - 1;
        let (lo, hi) = (bounds[k], bounds[k + 1]);
        let frac = if hi > lo {
            (i.min(hi) - lo) as f64 / (hi - lo) as f64
        } else {
            0.0
        };
        edges[k] + frac * (edges[k + 1] - edges[k])
    }
}

/// The points of a polyline reduced to what a screen shows: of each run of consecutive points
/// within one half-pixel column, the first, the highest, the lowest and the last, in their
/// order, so no peak or trough is lost and a chart of 100,000 events stays a few thousand
/// points.
fn thin_to_pixels(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(points.len().min(4 * 2 * TIMELINE_WIDTH as usize));
    let mut k = 0;
    while k < points.len() {
        let column = (points[k].0 * 2.0).floor();
        let mut end = k + 1;
        while end < points.len() && (points[end].0 * 2.0).floor() == column {
            end += 1;
        }
        let run = &points[k..end];
        let (mut lo, mut hi) = (0, 0);
        for (i, p) in run.iter().enumerate() {
            if p.1 < run[lo].1 {
                lo = i;
            }
            if p.1 > run[hi].1 {
                hi = i;
            }
        }
        let mut keep = [0, lo, hi, run.len() - 1];
        keep.sort_unstable();
        let mut last = None;
        for i in keep {
            if last != Some(i) {
                out.push(run[i]);
                last = Some(i);
            }
        }
        k = end;
    }
    out
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::{thin_to_pixels, time_axis};

    #[test]
    fn a_short_phase_keeps_a_visible_share_of_the_axis() {
        use super::super::training::Phase;
        // 1,000 events: forward 0..400, backward 400..998, step 998..1000.
        let starts = [
            (0, Phase::Forward),
            (400, Phase::Backward),
            (998, Phase::Step),
        ];
        let x = super::event_axis(&starts, 1000, 0.0, 100.0);
        assert_eq!(x(0), 0.0);
        assert!((x(1000) - 100.0).abs() < 1e-9);
        let xs: Vec<f64> = (0..=1000).map(&x).collect();
        assert!(xs.windows(2).all(|w| w[0] <= w[1]), "monotonic");
        let step_share = (x(1000) - x(998)) / 100.0;
        assert!((step_share - 0.06 / 1.058).abs() < 1e-9, "{step_share}");
    }

    #[test]
    fn the_time_axis_is_linear_in_the_timestamps() {
        // Four figures: the start (the first event's time), then events at 0, 100 and 400 µs.
        let times = [5_000, 5_000, 5_100, 5_400];
        let x = time_axis(&times, 10.0, 400.0);
        let xs: Vec<f64> = (0..4).map(&x).collect();
        assert_eq!(xs, [10.0, 10.0, 110.0, 410.0]);
        // No events: one figure at the left edge.
        assert_eq!(time_axis(&[0], 10.0, 400.0)(0), 10.0);
    }

    #[test]
    fn thinning_keeps_the_extremes_of_each_column_in_order() {
        // 10,000 points over 100 pixels: 200 half-pixel columns of 50 points each.
        let points: Vec<(f64, f64)> = (0..10_000)
            .map(|i| (i as f64 / 100.0, (i * 7919 % 1000) as f64))
            .collect();
        let kept = thin_to_pixels(&points);
        assert!(kept.len() <= 4 * 200, "{}", kept.len());
        assert!(kept.windows(2).all(|w| w[0].0 <= w[1].0));
        let max = |p: &[(f64, f64)]| p.iter().map(|p| p.1).fold(f64::MIN, f64::max);
        let min = |p: &[(f64, f64)]| p.iter().map(|p| p.1).fold(f64::MAX, f64::min);
        assert_eq!(max(&kept), max(&points));
        assert_eq!(min(&kept), min(&points));
        assert_eq!(kept.first(), points.first());
        assert_eq!(kept.last(), points.last());
        // Points a pixel apart are all kept; a vertical step keeps both ends.
        let few = [(0.0, 3.0), (1.0, 1.0), (1.0, 5.0), (2.0, 2.0)];
        assert_eq!(thin_to_pixels(&few), few);
    }
}
