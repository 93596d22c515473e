//! What `kvx bench` reports of its rows: the table, the CSV and the plot.

use std::path::Path;
use std::time::Duration;

use kvx_core::{Error, ErrorKind, Result};
use kvx_testkit::xproc::Shape;

use super::Transport;
use crate::backend::Backend;

/// The CSV header, one column per field of [`Row`].
pub(crate) const CSV_HEADER: &str =
    "backend,transport,block_bytes,blocks,gbps,baseline,baseline_gbps,ratio,p50_us,p99_us,cpu_s_per_gb";

/// One measured row.
#[derive(Debug, Clone)]
pub(super) struct Row {
    pub(super) backend: Backend,
    pub(super) transport: Transport,
    pub(super) shape: Shape,
    pub(super) gbps: f64,
    pub(super) baseline: String,
    pub(super) baseline_gbps: f64,
    pub(super) p50: Duration,
    pub(super) p99: Duration,
    /// CPU seconds per GB moved, over the timed READs: the reader's and the target's processes
    /// together (all their threads).
    pub(super) cpu_s_per_gb: f64,
    /// Rounds whose every byte was checked.
    pub(super) verified: usize,
}

impl Row {
    fn ratio(&self) -> f64 {
        self.gbps / self.baseline_gbps
    }

    /// The row's CSV cells, in [`CSV_HEADER`]'s order.
    pub(super) fn cells(&self) -> [String; 11] {
        [
            self.backend.name().to_owned(),
            self.transport.name().to_owned(),
            self.shape.block_len.to_string(),
            self.shape.reads.to_string(),
            format!("{:.3}", self.gbps),
            self.baseline.clone(),
            format!("{:.3}", self.baseline_gbps),
            format!("{:.3}", self.ratio()),
            format!("{:.1}", micros(self.p50)),
            format!("{:.1}", micros(self.p99)),
            format!("{:.2}", self.cpu_s_per_gb),
        ]
    }

    pub(super) fn table_line(&self) -> String {
        let [backend, transport, _, _, gbps, baseline, baseline_gbps, ratio, p50, p99, cpu] = self.cells();
        let block = size_text(self.shape.block_len);
        format!(
            "{backend:<9} {transport:<5} {block:>8} {gbps:>8} {baseline:<10} {baseline_gbps:>8} {ratio:>6} {p50:>10} \
             {p99:>10} {cpu:>8}  yes ({} rounds)",
            self.verified
        )
    }
}

pub(super) const TABLE_HEADER: &str = "backend   link     block     GB/s baseline       GB/s  ratio    p50 µs     p99 µs CPU s/GB  every byte verified";

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

pub(super) fn size_text(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// Draws each backend and transport's GB/s against block size, its baseline dashed in its color.
pub(super) fn plot(path: &Path, rows: &[Row]) -> Result<()> {
    use plotters::prelude::*;
    let draw_error =
        |e: &dyn std::fmt::Display| Error::new(ErrorKind::Io, format!("--plot {}: {e}", path.display()));
    // Block sizes on a log2 axis, one tick per power of two.
    let log2 = |row: &Row| (row.shape.block_len as f64).log2();
    let (lo, hi) = rows.iter().map(log2).fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let (lo, hi) = if rows.is_empty() { (10.0, 20.0) } else { (lo.floor() - 1.0, hi.ceil() + 1.0) };
    let top = rows.iter().flat_map(|r| [r.gbps, r.baseline_gbps]).fold(1.0, f64::max) * 1.15;

    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw_error(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("kvx bench: READ of scattered blocks, GB/s (1e9 B/s) against block size", ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(lo..hi, 0f64..top)
        .map_err(|e| draw_error(&e))?;
    chart
        .configure_mesh()
        .x_desc("block size")
        .y_desc("GB/s")
        .x_labels((hi - lo) as usize + 1)
        .x_label_formatter(&|x| size_text(x.exp2().round() as usize))
        .draw()
        .map_err(|e| draw_error(&e))?;
    let mut pairs: Vec<(Backend, Transport)> = Vec::new();
    for row in rows {
        if !pairs.contains(&(row.backend, row.transport)) {
            pairs.push((row.backend, row.transport));
        }
    }
    for (i, &(backend, transport)) in pairs.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mut of_pair: Vec<&Row> =
            rows.iter().filter(|r| (r.backend, r.transport) == (backend, transport)).collect();
        of_pair.sort_by_key(|r| r.shape.block_len);
        let kvx: Vec<(f64, f64)> = of_pair.iter().map(|r| (log2(r), r.gbps)).collect();
        let base: Vec<(f64, f64)> = of_pair.iter().map(|r| (log2(r), r.baseline_gbps)).collect();
        chart
            .draw_series(LineSeries::new(kvx.clone(), color.stroke_width(3)))
            .map_err(|e| draw_error(&e))?
            .label(format!("kvx {} {}", backend.name(), transport.name()))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
        chart
            .draw_series(kvx.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| draw_error(&e))?;
        chart
            .draw_series(DashedLineSeries::new(base, 6, 4, color.stroke_width(1)))
            .map_err(|e| draw_error(&e))?
            .label(format!(
                "baseline: {} ({} {})",
                of_pair.first().map_or("", |r| r.baseline.as_str()),
                backend.name(),
                transport.name()
            ))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(1)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| draw_error(&e))?;
    root.present().map_err(|e| draw_error(&e))
}
