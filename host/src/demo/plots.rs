//! SVG plots of the results (plotters): time against size, bandwidth against
//! size, and the timeline of one pipelined run.

use plotters::prelude::*;
use std::path::Path;

fn err(e: impl std::fmt::Display) -> gpufeed::Error {
    gpufeed::Error::InvalidArgument(format!("plot: {e}"))
}

/// One named series of (x, y) points.
pub struct Series<'a> {
    pub name: &'a str,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// How an axis labels its ticks.
#[derive(Clone, Copy)]
pub enum Label {
    /// Byte sizes: `1 MiB`, `1 GiB`.
    Bytes,
    /// Element counts: `10⁶`, `3×10⁶`.
    Count,
    /// Plain numbers without trailing zeros.
    Number,
}

impl Label {
    fn format(self, v: f64) -> String {
        match self {
            Label::Bytes => super::fmt::bytes(v.round().max(0.0) as u64),
            Label::Count => super::fmt::count(v.round().max(0.0) as u64),
            Label::Number => super::fmt::number(v),
        }
    }
}

/// One axis of a line chart.
pub struct Axis<'a> {
    pub desc: &'a str,
    pub label: Label,
}

/// Ticks of a logarithmic axis over `lo..hi`: the data's own x values, or for
/// y the 1-2-5 steps of each decade.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut v = Vec::new();
    let mut decade = 10f64.powf(lo.log10().floor());
    while decade <= hi {
        for m in [1.0, 2.0, 5.0] {
            let t = decade * m;
            if t >= lo && t <= hi {
                v.push(t);
            }
        }
        decade *= 10.0;
    }
    v
}

/// Height of the legend strip under a chart with `n` entries, `per_row` a row.
fn legend_height(n: usize, per_row: usize) -> u32 {
    12 + 22 * n.div_ceil(per_row) as u32
}

/// The legend, drawn in its own strip below the chart so that it never
/// covers data: a swatch (a line, or a filled box) and the name, `per_row`
/// a row.
fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    entries: &[(&str, RGBColor)],
    per_row: usize,
    boxes: bool,
) -> gpufeed::Result<()> {
    let (w, _) = area.dim_in_pixel();
    let per_row = per_row.max(1) as i32;
    let col = (w as i32 - 100) / per_row;
    let style = ("sans-serif", 15).into_font().color(&BLACK);
    for (i, (name, c)) in entries.iter().enumerate() {
        let x = 80 + (i as i32 % per_row) * col;
        let y = 14 + (i as i32 / per_row) * 22;
        if boxes {
            area.draw(&Rectangle::new([(x, y - 6), (x + 18, y + 6)], c.filled()))
                .map_err(err)?;
        } else {
            area.draw(&PathElement::new(
                vec![(x, y), (x + 24, y)],
                c.stroke_width(3),
            ))
            .map_err(err)?;
            area.draw(&Circle::new((x + 12, y), 3, c.filled()))
                .map_err(err)?;
        }
        area.draw(&Text::new(name.to_string(), (x + 32, y - 8), style.clone()))
            .map_err(err)?;
    }
    Ok(())
}

/// A line chart: x logarithmic with a tick at each x of the data, y
/// logarithmic (1-2-5 ticks) or linear from zero.
pub fn lines(
    path: &Path,
    title: &str,
    x: Axis,
    y: Axis,
    log_y: bool,
    series: &[Series],
) -> gpufeed::Result<()> {
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite() && *x > 0.0 && *y > 0.0)
        .collect();
    if all.is_empty() {
        return Ok(());
    }
    let (x0, x1) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let mut xs: Vec<f64> = all.iter().map(|p| p.0).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let legend_h = legend_height(series.len(), 2);
    let root = SVGBackend::new(path, (900, 540 + legend_h)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (plot_area, legend_area) = root.split_vertically(540);
    let mut builder = ChartBuilder::on(&plot_area);
    builder
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70);
    let (xl, yl) = (x.label, y.label);
    macro_rules! finish {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x.desc)
                .y_desc(y.desc)
                .x_label_formatter(&|v| xl.format(*v))
                .y_label_formatter(&|v| yl.format(*v))
                .label_style(("sans-serif", 14))
                .axis_desc_style(("sans-serif", 15))
                .draw()
                .map_err(err)?;
            for (i, s) in series.iter().enumerate() {
                let c = COLORS[i % COLORS.len()];
                chart
                    .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                    .map_err(err)?;
                chart
                    .draw_series(s.points.iter().map(|p| Circle::new(*p, 3, c.filled())))
                    .map_err(err)?;
            }
        }};
    }
    let xr = ((x0 / 1.25)..(x1 * 1.25)).log_scale().with_key_points(xs);
    if log_y {
        let (ya, yb) = (y0 / 1.25, y1 * 1.25);
        finish!(builder
            .build_cartesian_2d(xr, (ya..yb).log_scale().with_key_points(log_ticks(ya, yb)))
            .map_err(err)?);
    } else {
        finish!(builder
            .build_cartesian_2d(xr, 0.0..(y1 * 1.15))
            .map_err(err)?);
    }
    let entries: Vec<(&str, RGBColor)> = series
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name, COLORS[i % COLORS.len()]))
        .collect();
    legend(&legend_area, &entries, 2, false)?;
    root.present().map_err(err)?;
    super::report::announce(path);
    Ok(())
}

/// A bar on the timeline: lane index, start and end in ms, and its kind
/// (0 = H2D, 1 = kernel, 2 = D2H).
pub struct Bar {
    pub lane: usize,
    pub start: f64,
    pub end: f64,
    pub kind: usize,
}

/// The stream/engine timeline of one pipelined run.
pub fn timeline(
    path: &Path,
    title: &str,
    x_desc: &str,
    lanes: &[String],
    bars: &[Bar],
) -> gpufeed::Result<()> {
    let end = bars.iter().map(|b| b.end).fold(0.0, f64::max).max(1e-3);
    let plot_h = 120 + 34 * lanes.len() as u32;
    let root = SVGBackend::new(path, (1100, plot_h + legend_height(3, 3))).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (plot_area, legend_area) = root.split_vertically(plot_h);
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(150)
        .build_cartesian_2d(0.0..end * 1.02, 0.0..lanes.len() as f64)
        .map_err(err)?;
    let lane_names = lanes.to_vec();
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .x_label_formatter(&|v| super::fmt::number(*v))
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 15))
        .y_labels(lanes.len() * 2 + 1)
        .y_label_formatter(&move |y| {
            let i = y.floor() as usize;
            if (y - y.floor() - 0.5).abs() < 0.26 {
                lane_names
                    .get(lanes_rev(i, lane_names.len()))
                    .cloned()
                    .unwrap_or_default()
            } else {
                String::new()
            }
        })
        .disable_y_mesh()
        .draw()
        .map_err(err)?;
    let kinds = [
        ("H2D copy", COLORS[0]),
        ("kernel", COLORS[2]),
        ("D2H copy", COLORS[1]),
    ];
    let n = lanes.len();
    for (k, (_, color)) in kinds.into_iter().enumerate() {
        chart
            .draw_series(bars.iter().filter(|b| b.kind == k).map(|b| {
                let y = (n - 1 - b.lane) as f64;
                Rectangle::new(
                    [
                        (b.start, y + 0.15),
                        (b.end.max(b.start + end * 0.002), y + 0.85),
                    ],
                    color.filled(),
                )
            }))
            .map_err(err)?;
    }
    legend(&legend_area, &kinds, 3, true)?;
    root.present().map_err(err)?;
    super::report::announce(path);
    Ok(())
}

fn lanes_rev(i: usize, n: usize) -> usize {
    n.saturating_sub(1).saturating_sub(i)
}
