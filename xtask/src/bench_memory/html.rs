//! `bench-memory --html`: one self-contained page (inline SVG, no script, no external file) with,
//! per model and batch, the traced step's peak split by component for each case, and each case's
//! requested bytes over that step with its phases shaded.
//!
//! It reads [`CaseResult`]s only; it runs nothing and knows no device.

use std::fmt::Write as _;

use super::cases::{CaseResult, Phase};
use super::report::{size, Anchors};

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
         gap:8px 24px}}</style></head><body>\n<h1>{t}</h1>\n<p>Peaks are the traced step's \
         allocated bytes split by what held them at the moment of the peak; the timelines show \
         the allocator's requested bytes after each allocation or free of that step, two cases a \
         row (a case stepped in backward beside the same optimizer stepped after it).</p>\n",
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
    let pytorch = |r: &CaseResult| {
        anchors
            .get(&(r.case.pytorch_name().to_owned(), r.batch))
            .map(|a| a.steady_peak_alloc)
    };
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
        let _ = writeln!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
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
/// y axis alike for every case of a group. Each phase spans a width proportional to its events
/// but at least [`MIN_PHASE_SHARE`] of the plot, so a step of two events stays visible.
fn timeline_chart(r: &CaseResult, top: u64) -> String {
    let (w, h, left, top_y, bottom) = (TIMELINE_WIDTH, 180.0, 70.0, 30.0, 22.0);
    let plot_w = w - left - 10.0;
    let plot_h = h - bottom - top_y;
    let points = &r.timeline.bytes;
    let n = points.len().max(2) - 1;
    let x_of = event_axis(&r.timeline.phase_starts, n, left, plot_w);
    let y_of = |b: u64| top_y + plot_h - b as f64 / top as f64 * plot_h;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\">\n\
         <text x=\"0\" y=\"14\" font-weight=\"bold\">{} — requested bytes over the traced step \
         ({} events)</text>\n",
        r.case.name(),
        points.len() - 1
    );
    let starts = &r.timeline.phase_starts;
    for (k, (start, phase)) in starts.iter().enumerate() {
        let end = starts.get(k + 1).map_or(n, |(s, _)| *s);
        let _ = writeln!(
            svg,
            "<rect x=\"{:.1}\" y=\"{top_y}\" width=\"{:.1}\" height=\"{plot_h:.1}\" \
             fill=\"{}\"/><text x=\"{:.1}\" y=\"{:.1}\" fill=\"#555\">{}</text>",
            x_of(*start),
            (x_of(end) - x_of(*start)).max(0.5),
            phase_colour(*phase),
            x_of(*start) + 3.0,
            top_y + 12.0,
            phase.label()
        );
    }
    let mut path = String::new();
    for (i, bytes) in downsample(points) {
        let _ = write!(path, "{:.1},{:.1} ", x_of(i), y_of(bytes));
    }
    let _ = writeln!(
        svg,
        "<polyline fill=\"none\" stroke=\"#4e79a7\" stroke-width=\"1.5\" points=\"{}\"/>",
        path.trim_end()
    );
    let peak = r.timeline.peak_index;
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
    let _ = writeln!(
        svg,
        "<text x=\"{left}\" y=\"{:.1}\" fill=\"#555\">allocator events →</text>",
        h - 4.0
    );
    svg.push_str("</svg>\n");
    svg
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

/// At most about 1,200 points: the first, the last, and each bucket's minimum and maximum in
/// order, so no peak or trough is lost.
fn downsample(points: &[u64]) -> Vec<(usize, u64)> {
    const BUCKETS: usize = 600;
    if points.len() <= 2 * BUCKETS {
        return points.iter().copied().enumerate().collect();
    }
    let per = points.len().div_ceil(BUCKETS);
    let mut out = Vec::with_capacity(2 * BUCKETS + 2);
    for (b, chunk) in points.chunks(per).enumerate() {
        let base = b * per;
        let (lo, hi) = chunk.iter().enumerate().fold((0, 0), |(lo, hi), (i, v)| {
            (
                if *v < chunk[lo] { i } else { lo },
                if *v > chunk[hi] { i } else { hi },
            )
        });
        let (first, second) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        out.push((base + first, chunk[first]));
        if second != first {
            out.push((base + second, chunk[second]));
        }
    }
    if out.last().map(|(i, _)| *i) != Some(points.len() - 1) {
        out.push((points.len() - 1, points[points.len() - 1]));
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
    use super::downsample;

    #[test]
    fn a_short_phase_keeps_a_visible_share_of_the_axis() {
        use super::super::cases::Phase;
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
    fn downsampling_keeps_the_extremes_in_order() {
        let points: Vec<u64> = (0..10_000).map(|i| (i * 7919 % 1000) as u64).collect();
        let kept = downsample(&points);
        assert!(kept.len() <= 1202, "{}", kept.len());
        assert!(kept.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(kept.iter().map(|p| p.1).max(), points.iter().copied().max());
        assert_eq!(kept.iter().map(|p| p.1).min(), points.iter().copied().min());
        assert_eq!(kept.last(), Some(&(9999, points[9999])));
        assert_eq!(downsample(&[3, 1, 2]), [(0, 3), (1, 1), (2, 2)]);
    }
}
