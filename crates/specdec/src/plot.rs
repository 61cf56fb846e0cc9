//! The benchmark's SVG: median decode tokens/s per mode, and the measured verification cost curve.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use crate::bench::Row;
use crate::calibration::Calibration;

/// Draws both charts side by side into `path`.
pub fn draw(path: &Path, rows: &[Row], cal: &Calibration) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let root = SVGBackend::new(path, (1000, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(500);

    let all: Vec<&Row> = rows.iter().filter(|r| r.category == "all").collect();
    let top = all
        .iter()
        .map(|r| r.median_tokens_per_s)
        .fold(1.0, f64::max)
        * 1.2;
    let mut chart = ChartBuilder::on(&left)
        .caption("median decode tokens/s", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(30)
        .y_label_area_size(45)
        .build_cartesian_2d((0..all.len()).into_segmented(), 0.0..top)
        .map_err(|e| err(&e))?;
    let names: Vec<String> = all.iter().map(|r| r.mode.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => names.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series(all.iter().enumerate().map(|(i, r)| {
            let mut bar = Rectangle::new(
                [
                    (SegmentValue::Exact(i), 0.0),
                    (SegmentValue::Exact(i + 1), r.median_tokens_per_s),
                ],
                BLUE.mix(0.6).filled(),
            );
            bar.set_margin(0, 0, 12, 12);
            bar
        }))
        .map_err(|e| err(&e))?;

    let rmax = cal.r.iter().copied().fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&right)
        .caption("target cost r(m) = t(m) / t(1)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(30)
        .y_label_area_size(45)
        .build_cartesian_2d(1usize..cal.r.len(), 0.0..rmax)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("tokens scored in one pass (m)")
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(
            cal.r.iter().enumerate().map(|(i, &r)| (i + 1, r)),
            RED.stroke_width(2),
        ))
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(
            (1..=cal.r.len()).map(|m| (m, m as f64)),
            BLACK.mix(0.3),
        ))
        .map_err(|e| err(&e))?
        .label("m (no reuse)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], BLACK.mix(0.3)));
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
