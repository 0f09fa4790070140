//! SVG plots of the results (plotters): time against size, bandwidth against
//! size, and the timeline of one pipelined run.

use plotters::prelude::*;
use std::path::Path;

fn err(e: impl std::fmt::Display) -> host::Error {
    host::Error::InvalidArgument(format!("plot: {e}"))
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

/// A log-log (or log-x) line chart.
pub fn lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    log_y: bool,
    series: &[Series],
) -> host::Result<()> {
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
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70);
    macro_rules! finish {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_desc)
                .y_desc(y_desc)
                .draw()
                .map_err(err)?;
            for (i, s) in series.iter().enumerate() {
                let c = COLORS[i % COLORS.len()];
                chart
                    .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                    .map_err(err)?
                    .label(s.name)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
                chart
                    .draw_series(s.points.iter().map(|p| Circle::new(*p, 3, c.filled())))
                    .map_err(err)?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .map_err(err)?;
        }};
    }
    let xr = (x0 * 0.8)..(x1 * 1.25);
    if log_y {
        finish!(builder
            .build_cartesian_2d(xr.log_scale(), ((y0 * 0.8)..(y1 * 1.25)).log_scale())
            .map_err(err)?);
    } else {
        finish!(builder
            .build_cartesian_2d(xr.log_scale(), 0.0..(y1 * 1.15))
            .map_err(err)?);
    }
    root.present().map_err(err)?;
    println!("wrote {}", path.display());
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
pub fn timeline(path: &Path, title: &str, lanes: &[String], bars: &[Bar]) -> host::Result<()> {
    let end = bars.iter().map(|b| b.end).fold(0.0, f64::max).max(1e-3);
    let root = SVGBackend::new(path, (1100, 120 + 34 * lanes.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(150)
        .build_cartesian_2d(0.0..end * 1.02, 0.0..lanes.len() as f64)
        .map_err(err)?;
    let lane_names = lanes.to_vec();
    chart
        .configure_mesh()
        .x_desc("ms since the first copy was issued (GPU clock, from events)")
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
    for (k, (name, color)) in kinds.into_iter().enumerate() {
        let n = lanes.len();
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
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    println!("wrote {}", path.display());
    Ok(())
}

fn lanes_rev(i: usize, n: usize) -> usize {
    n.saturating_sub(1).saturating_sub(i)
}
