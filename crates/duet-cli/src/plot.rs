//! A latency-percentile chart as a PNG, with no plotting dependency: a tiny raster, a 3×5 pixel
//! font, and a PNG encoder using stored (uncompressed) deflate blocks.

use std::path::Path;

use anyhow::{Context, Result};

use crate::bench_serve::RunReport;

const W: usize = 900;
const H: usize = 420;
const SCALE: usize = 2; // font pixel size

struct Canvas {
    px: Vec<[u8; 3]>,
}

impl Canvas {
    fn new() -> Self {
        Self {
            px: vec![[255, 255, 255]; W * H],
        }
    }

    fn rect(&mut self, x: usize, y: usize, w: usize, h: usize, c: [u8; 3]) {
        for yy in y.min(H)..(y + h).min(H) {
            for xx in x.min(W)..(x + w).min(W) {
                self.px[yy * W + xx] = c;
            }
        }
    }

    fn text(&mut self, mut x: usize, y: usize, s: &str, c: [u8; 3]) {
        for ch in s.chars() {
            let g = glyph(ch.to_ascii_uppercase());
            for (row, bits) in g.iter().enumerate() {
                for col in 0..3 {
                    if bits & (0b100 >> col) != 0 {
                        self.rect(x + col * SCALE, y + row * SCALE, SCALE, SCALE, c);
                    }
                }
            }
            x += 4 * SCALE;
        }
    }
}

/// 3×5 glyphs, one row per entry, bit 2 = left column.
fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 7, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 1, 1],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        'A' => [2, 5, 7, 5, 5],
        'B' => [6, 5, 6, 5, 6],
        'C' => [7, 4, 4, 4, 7],
        'D' => [6, 5, 5, 5, 6],
        'E' => [7, 4, 6, 4, 7],
        'F' => [7, 4, 6, 4, 4],
        'G' => [7, 4, 5, 5, 7],
        'H' => [5, 5, 7, 5, 5],
        'I' => [7, 2, 2, 2, 7],
        'J' => [1, 1, 1, 5, 7],
        'K' => [5, 5, 6, 5, 5],
        'L' => [4, 4, 4, 4, 7],
        'M' => [5, 7, 7, 5, 5],
        'N' => [6, 5, 5, 5, 5],
        'O' => [7, 5, 5, 5, 7],
        'P' => [7, 5, 7, 4, 4],
        'Q' => [7, 5, 5, 7, 1],
        'R' => [7, 5, 6, 5, 5],
        'S' => [7, 4, 7, 1, 7],
        'T' => [7, 2, 2, 2, 2],
        'U' => [5, 5, 5, 5, 7],
        'V' => [5, 5, 5, 5, 2],
        'W' => [5, 5, 7, 7, 5],
        'X' => [5, 5, 2, 5, 5],
        'Y' => [5, 5, 2, 2, 2],
        'Z' => [7, 1, 2, 4, 7],
        '.' => [0, 0, 0, 0, 2],
        ':' => [0, 2, 0, 2, 0],
        '/' => [1, 1, 2, 4, 4],
        '-' => [0, 0, 7, 0, 0],
        '%' => [5, 1, 2, 4, 5],
        '(' => [1, 2, 2, 2, 1],
        ')' => [4, 2, 2, 2, 4],
        _ => [0, 0, 0, 0, 0],
    }
}

const COLORS: [[u8; 3]; 4] = [[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40]];

/// Two panels (TTFT and TPOT), p50/p90/p99 bars per design.
pub fn latency_percentiles(runs: &[RunReport], out: &Path) -> Result<()> {
    let mut c = Canvas::new();
    c.text(
        20,
        10,
        "LATENCY PERCENTILES (MS) - BARS: P50 P90 P99 PER DESIGN",
        [0, 0, 0],
    );
    type Metric = fn(&RunReport) -> [f64; 3];
    let panels: [(&str, Metric); 2] = [
        ("TIME TO FIRST TOKEN", |r| {
            [r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99]
        }),
        ("TIME PER OUTPUT TOKEN", |r| {
            [r.tpot_ms.p50, r.tpot_ms.p90, r.tpot_ms.p99]
        }),
    ];
    for (pi, (title, get)) in panels.iter().enumerate() {
        let x0 = 40 + pi * (W / 2);
        let (y0, ph) = (60, H - 130);
        c.text(x0, y0 - 20, title, [0, 0, 0]);
        let max = runs.iter().flat_map(*get).fold(1e-9, f64::max);
        c.text(x0 - 30, y0, &format!("{max:.0}"), [90, 90, 90]);
        c.rect(x0, y0 + ph, W / 2 - 80, 1, [0, 0, 0]);
        let group_w = (W / 2 - 90) / runs.len().max(1);
        for (ri, r) in runs.iter().enumerate() {
            let vals = get(r);
            let bar_w = group_w / 4;
            for (k, v) in vals.iter().enumerate() {
                let h = ((v / max) * ph as f64) as usize;
                let x = x0 + 10 + ri * group_w + k * bar_w;
                c.rect(x, y0 + ph - h, bar_w - 2, h, COLORS[ri % COLORS.len()]);
            }
            c.text(
                x0 + 10 + ri * group_w,
                y0 + ph + 10,
                &r.design,
                COLORS[ri % COLORS.len()],
            );
            c.text(
                x0 + 10 + ri * group_w,
                y0 + ph + 26,
                &format!("{:.0}/{:.0}/{:.0}", vals[0], vals[1], vals[2]),
                [60, 60, 60],
            );
        }
    }
    std::fs::write(out, encode_png(&c)).with_context(|| format!("writing {}", out.display()))
}

fn encode_png(c: &Canvas) -> Vec<u8> {
    let mut raw = Vec::with_capacity(H * (1 + 3 * W));
    for row in c.px.chunks(W) {
        raw.push(0); // filter: none
        for p in row {
            raw.extend_from_slice(p);
        }
    }
    // zlib stream of stored deflate blocks.
    let mut z = vec![0x78, 0x01];
    let chunks: Vec<&[u8]> = raw.chunks(65_535).collect();
    for (i, block) in chunks.iter().enumerate() {
        z.push(u8::from(i + 1 == chunks.len()));
        let len = block.len() as u16;
        z.extend_from_slice(&len.to_le_bytes());
        z.extend_from_slice(&(!len).to_le_bytes());
        z.extend_from_slice(block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in &raw {
        a = (a + x as u32) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend_from_slice(&((b << 16) | a).to_be_bytes());

    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(W as u32).to_be_bytes());
    ihdr.extend_from_slice(&(H as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB
    chunk(&mut png, b"IHDR", &ihdr);
    chunk(&mut png, b"IDAT", &z);
    chunk(&mut png, b"IEND", &[]);
    png
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let mut crc = !0u32;
    for &byte in kind.iter().chain(data) {
        crc ^= byte as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    out.extend_from_slice(&(!crc).to_be_bytes());
}
