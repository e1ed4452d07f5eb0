//! `vrtspike plot`: one figure of a run (PNG or SVG, by the file's extension) with
//! `plotters`: training loss raw and smoothed (with the blurry input's loss for
//! reference), validation PSNR beside the input's PSNR, samples/s, time per step
//! (whole, data wait, communication), host memory and GPU memory over steps, every
//! panel marking the restarts.
//!
//! Text is drawn with `ab_glyph` from the DejaVu Sans file of Debian's
//! `fonts-dejavu-core` (read at run time, nothing embedded); `VRTSPIKE_FONT` names
//! another TrueType file.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::run::RunData;
use super::MonitorError;

/// The figure's size in pixels.
const SIZE: (u32, u32) = (1800, 1500);
/// The figure's default name in the run directory.
pub const PLOT_FILE: &str = "plot.png";
/// Where the font is looked for, in order (after `VRTSPIKE_FONT`).
const FONT_PATHS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];
const FONT: &str = "sans-serif";

/// One curve of a panel.
struct Curve {
    label: String,
    points: Vec<(f64, f64)>,
    color: RGBColor,
    width: u32,
    marks: bool,
}

/// One panel of the figure.
struct Panel {
    title: &'static str,
    y_label: &'static str,
    curves: Vec<Curve>,
}

/// The colours of the curves.
const BLUE: RGBColor = RGBColor(20, 70, 170);
const LIGHT_BLUE: RGBColor = RGBColor(150, 190, 235);
const GREEN: RGBColor = RGBColor(0, 140, 60);
const ORANGE: RGBColor = RGBColor(200, 100, 0);
const PURPLE: RGBColor = RGBColor(160, 40, 160);
const GREY: RGBColor = RGBColor(120, 120, 120);

fn curve(label: &str, points: Vec<(f64, f64)>, color: RGBColor, width: u32) -> Curve {
    Curve {
        label: label.to_string(),
        points,
        color,
        width,
        marks: false,
    }
}

/// The curve with a mark at each point (sparse series such as validation).
fn marked(curve: Curve) -> Curve {
    Curve {
        marks: true,
        ..curve
    }
}

/// Registers the font once; the error names the files tried.
fn ensure_font() -> Result<(), String> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let mut candidates: Vec<PathBuf> = FONT_PATHS.iter().map(PathBuf::from).collect();
            if let Some(custom) = std::env::var_os("VRTSPIKE_FONT") {
                candidates.insert(0, PathBuf::from(custom));
            }
            let found = candidates.iter().find_map(|p| std::fs::read(p).ok());
            let Some(bytes) = found else {
                return Err(format!(
                    "no font: install Debian's fonts-dejavu-core or set VRTSPIKE_FONT (tried {candidates:?})"
                ));
            };
            // The font table of plotters keeps `'static` references: the file is read
            // once per process and kept.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font(FONT, FontStyle::Normal, bytes)
                .map_err(|_| "the font file is not TrueType/OpenType".to_string())
        })
        .clone()
}

/// TensorBoard's smoothing: an exponential moving average with bias correction.
pub fn smooth(points: &[(f64, f64)], weight: f64) -> Vec<(f64, f64)> {
    let mut average = 0.0;
    let mut debias = 1.0;
    points
        .iter()
        .map(|&(x, y)| {
            average = weight * average + (1.0 - weight) * y;
            debias *= weight;
            (x, average / (1.0 - debias))
        })
        .collect()
}

/// The smoothing weight for `n` points: stronger for longer runs.
fn smoothing_weight(n: usize) -> f64 {
    (1.0 - 10.0 / n.max(1) as f64).clamp(0.0, 0.95)
}

fn scaled(points: Vec<(f64, f64)>, factor: f64) -> Vec<(f64, f64)> {
    points.into_iter().map(|(x, y)| (x, y * factor)).collect()
}

/// The six panels of `run`.
fn panels(run: &RunData) -> Vec<Panel> {
    let train = |column| RunData::series(&run.train, column);
    let val = |column| RunData::series(&run.val, column);
    let gib = |column| scaled(RunData::series(&run.memory, column), 1.0 / 1024.0);
    let loss = train("loss");
    let smoothed = smooth(&loss, smoothing_weight(loss.len()));
    let panel = |title, y_label, curves| Panel {
        title,
        y_label,
        curves,
    };
    vec![
        panel(
            "training loss",
            "Charbonnier loss",
            vec![
                curve("raw", loss, LIGHT_BLUE, 1),
                curve("smoothed", smoothed, BLUE, 3),
                curve("input (blurry)", train("input_loss"), GREY, 2),
            ],
        ),
        panel(
            "validation PSNR",
            "PSNR (dB)",
            vec![
                marked(curve("output", val("val_psnr"), GREEN, 3)),
                marked(curve("input (blurry)", val("input_psnr"), GREY, 2)),
            ],
        ),
        panel(
            "throughput",
            "samples/s",
            vec![curve("samples/s", train("samples_per_s"), ORANGE, 2)],
        ),
        panel(
            "time per step",
            "ms",
            vec![
                curve("step", train("step_time_ms"), BLUE, 2),
                curve("data wait", train("data_time_ms"), PURPLE, 2),
                curve("communication", train("comm_time_ms"), ORANGE, 2),
            ],
        ),
        panel(
            "host memory",
            "GiB",
            vec![
                curve("process Pss", gib("pss_mb"), BLUE, 2),
                curve("system used", gib("sys_used_mb"), GREY, 2),
            ],
        ),
        panel(
            "GPU memory",
            "GiB",
            vec![
                curve("allocated", gib("gpu_allocated_mb"), GREEN, 2),
                curve("reserved", gib("gpu_reserved_mb"), ORANGE, 2),
                curve("device used", gib("gpu_used_mb"), GREY, 2),
            ],
        ),
    ]
}

/// `lo..hi` of the curves' values with 8% padding below and 30% above (room for
/// the legend); a flat line gets a band of 10% of its value.
fn y_range(curves: &[Curve]) -> Option<(f64, f64)> {
    let values = curves.iter().flat_map(|c| c.points.iter().map(|p| p.1));
    let (lo, hi) = values.fold(None, |acc: Option<(f64, f64)>, v| {
        Some(acc.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v))))
    })?;
    let span = if hi > lo { hi - lo } else { lo.abs().max(1.0) };
    Some((lo - 0.08 * span, hi + 0.3 * span))
}

/// Decimals of the y labels for a range of `span`: none for hundreds of ms, three
/// for a loss around 0.03.
fn y_digits(span: f64) -> usize {
    if !(span.is_finite() && span > 0.0) {
        return 2;
    }
    (1.0 - span.log10().floor()).clamp(0.0, 5.0) as usize
}

type Drawn = Result<(), String>;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// One panel with its curves and restart marks.
fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    x_max: f64,
    restarts: &[f64],
) -> Drawn {
    let Some((y0, y1)) = y_range(&panel.curves) else {
        area.titled(panel.title, (FONT, 26))
            .map_err(err)?
            .draw_text(
                "no samples in this run",
                &(FONT, 20).into_font().color(&GREY),
                (40, 40),
            )
            .map_err(err)?;
        return Ok(());
    };
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, (FONT, 26))
        .margin(14)
        .x_label_area_size(48)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..x_max, y0..y1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.digits$}", digits = y_digits(y1 - y0)))
        .y_desc(panel.y_label)
        .label_style((FONT, 16))
        .axis_desc_style((FONT, 18))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(err)?;
    for c in panel.curves.iter().filter(|c| !c.points.is_empty()) {
        let style = c.color.stroke_width(c.width);
        let color = c.color;
        chart
            .draw_series(LineSeries::new(c.points.iter().copied(), style))
            .map_err(err)?
            .label(c.label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(4))
            });
        if c.marks {
            chart
                .draw_series(c.points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(err)?;
        }
    }
    let red = RGBColor(210, 30, 30);
    for (i, &step) in restarts.iter().enumerate() {
        let line = PathElement::new(vec![(step, y0), (step, y1)], red.stroke_width(2));
        let series = chart.draw_series(std::iter::once(line)).map_err(err)?;
        if i == 0 {
            series.label("restart").legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], red.stroke_width(4))
            });
        }
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 16))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(180, 180, 180))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)
}

/// The whole figure on `root`.
fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, run: &RunData, title: &str) -> Drawn {
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, (FONT, 30)).map_err(err)?;
    let restarts: Vec<f64> = run.restarts().iter().map(|s| s.step).collect();
    let panels = panels(run);
    let x_max = panels
        .iter()
        .flat_map(|p| p.curves.iter().flat_map(|c| c.points.iter().map(|q| q.0)))
        .chain(restarts.iter().copied())
        .fold(1.0f64, f64::max);
    for (area, panel) in root.split_evenly((3, 2)).iter().zip(&panels) {
        draw_panel(area, panel, x_max * 1.02, &restarts)?;
    }
    root.present().map_err(err)
}

/// The figure's title: the run directory's name, steps and restarts.
fn title(run: &RunData) -> String {
    let name = run
        .dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".into());
    let steps = run
        .train
        .last()
        .and_then(|r| r.get("step")?.as_u64())
        .map_or(String::new(), |s| format!(", {s} steps"));
    format!("{name}{steps}, {} restart(s)", run.restarts().len())
}

/// Draws the figure of `run` into `out` (`.svg` for SVG, PNG otherwise).
pub fn plot(run: &RunData, out: &Path) -> Result<(), MonitorError> {
    let fail = |message: String| MonitorError::Plot {
        path: out.to_path_buf(),
        message,
    };
    ensure_font().map_err(fail)?;
    let title = title(run);
    if out
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"))
    {
        return draw(SVGBackend::new(out, SIZE).into_drawing_area(), run, &title).map_err(fail);
    }
    let mut pixels = vec![0u8; SIZE.0 as usize * SIZE.1 as usize * 3];
    draw(
        BitMapBackend::with_buffer(&mut pixels, SIZE).into_drawing_area(),
        run,
        &title,
    )
    .map_err(fail)?;
    let image = super::tensorboard::RgbImage {
        width: SIZE.0,
        height: SIZE.1,
        pixels,
    };
    let png = image.to_png().map_err(|e| fail(e.to_string()))?;
    std::fs::write(out, png).map_err(|e| MonitorError::io(out, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothing_is_debiased() {
        let s = smooth(&[(1.0, 2.0), (2.0, 2.0), (3.0, 2.0)], 0.9);
        assert!(s.iter().all(|p| (p.1 - 2.0).abs() < 1e-12), "{s:?}");
        let s = smooth(&[(1.0, 0.0), (2.0, 10.0)], 0.5);
        assert!((s[1].1 - 10.0 * 0.5 / 0.75).abs() < 1e-12);
        assert_eq!(smoothing_weight(5), 0.0);
        assert_eq!(smoothing_weight(10_000), 0.95);
    }

    #[test]
    fn y_range_pads_and_handles_flat_lines() {
        assert_eq!((y_digits(560.0), y_digits(2.3), y_digits(0.045)), (0, 1, 3));
        let flat = [curve("a", vec![(0.0, 5.0), (1.0, 5.0)], BLACK, 1)];
        assert_eq!(y_range(&flat), Some((5.0 - 0.4, 5.0 + 1.5)));
        let span = [curve("c", vec![(0.0, 0.0), (1.0, 10.0)], BLACK, 1)];
        assert_eq!(y_range(&span), Some((-0.8, 13.0)));
        assert_eq!(y_range(&[curve("b", vec![], BLACK, 1)]), None);
    }

    #[test]
    fn png_and_svg_from_a_small_run() {
        if let Err(e) = ensure_font() {
            eprintln!("skipped: {e}");
            return;
        }
        let text = r#"{"kind":"event","event":"start","step":0,"restart_count":0}
{"kind":"train","step":10,"loss":0.5,"samples_per_s":4.0,"data_time_ms":3.0}
{"kind":"train","step":20,"loss":0.4,"samples_per_s":5.0,"data_time_ms":2.0}
{"kind":"event","event":"start","step":20,"restart_count":1}
{"kind":"val","step":20,"val_psnr":27.0,"input_psnr":25.0}
{"kind":"memory","step":20,"pss_mb":900.0,"sys_used_mb":9000.0}"#;
        let run = RunData::from_metrics(text);
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("p.png");
        plot(&run, &png).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        let svg = dir.path().join("p.svg");
        plot(&run, &svg).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.contains("validation PSNR") && text.contains("restart"));
        let bad = dir.path().join("missing/p.png");
        assert!(matches!(plot(&run, &bad), Err(MonitorError::Io { .. })));
    }
}
