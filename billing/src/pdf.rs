//! An invoice as a PDF finance can send: A4 pages written with `pdf-writer` (the typst
//! project's PDF writer), the standard Helvetica and Courier fonts (every reader has them, so
//! nothing is embedded), text in WinAnsi encoding.
//!
//! The page shows what the CSV and the console do ([`crate::rounding`]): each line's quantity
//! and its exact amount (sub-cent, as rated: no line is rounded), the rounding row, and the
//! total, the exact sum rounded once to the currency's minor unit — the same rule as the
//! dashboards, so the two agree to the cent. Long
//! invoices continue on further pages, each numbered "page n of N".

use pdf_writer::{Content, Finish, Name, Pdf, Rect, Ref, Str, TextStr};

use crate::invoice::{Invoice, ROUNDING_LINE};
use crate::money::{format_exact, format_minor};

const WIDTH: f32 = 595.0;
const HEIGHT: f32 = 842.0;
const MARGIN: f32 = 50.0;
/// Table text: Courier at this size is `0.6 × SIZE` points a character.
const SIZE: f32 = 9.0;
const LEADING: f32 = 12.0;
/// Characters per table column: line number, description, quantity, amount.
const COLS: [usize; 4] = [4, 50, 14, 22];
/// The lowest baseline of a table row before the page breaks.
const BOTTOM: f32 = 90.0;

const SANS: Name = Name(b"F1");
const SANS_BOLD: Name = Name(b"F2");
const MONO: Name = Name(b"F3");
const MONO_BOLD: Name = Name(b"F4");

/// `s` in WinAnsi (Windows-1252), `?` for what it cannot show.
fn win_ansi(s: &str) -> Vec<u8> {
    s.chars()
        .map(|c| match c {
            ' '..='~' => c as u8,
            '\u{a0}'..='\u{ff}' => c as u32 as u8,
            '€' => 0x80,
            '–' => 0x96,
            '—' => 0x97,
            '…' => 0x85,
            '‘' => 0x91,
            '’' => 0x92,
            '“' => 0x93,
            '”' => 0x94,
            _ => b'?',
        })
        .collect()
}

/// Split `text` into lines of at most `width` characters, at spaces where it can.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let mut word = word.to_string();
        while word.chars().count() > width {
            if !line.is_empty() {
                out.push(std::mem::take(&mut line));
            }
            let head: String = word.chars().take(width).collect();
            word = word.chars().skip(width).collect();
            out.push(head);
        }
        let len = line.chars().count();
        if len > 0 && len + 1 + word.chars().count() > width {
            out.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(&word);
    }
    if !line.is_empty() || out.is_empty() {
        out.push(line);
    }
    out
}

/// One table row: its cells, the description wrapped.
struct Row {
    number: String,
    description: Vec<String>,
    quantity: String,
    amount: String,
}

impl Row {
    fn height(&self) -> f32 {
        self.description.len() as f32 * LEADING
    }
}

fn pad(s: &str, width: usize, right: bool) -> String {
    let n = s.chars().count();
    let fill = " ".repeat(width.saturating_sub(n));
    if right {
        format!("{fill}{s}")
    } else {
        format!("{s}{fill}")
    }
}

fn row_text(cells: [&str; 4]) -> String {
    format!(
        "{}{}{}{}",
        pad(cells[0], COLS[0], false),
        pad(cells[1], COLS[1], false),
        pad(cells[2], COLS[2], true),
        pad(cells[3], COLS[3], true)
    )
}

fn text(c: &mut Content, font: Name, size: f32, x: f32, y: f32, s: &str) {
    c.begin_text();
    c.set_font(font, size);
    c.next_line(x, y);
    c.show(Str(&win_ansi(s)));
    c.end_text();
}

fn rule(c: &mut Content, y: f32) {
    c.set_line_width(0.5);
    c.move_to(MARGIN, y);
    c.line_to(WIDTH - MARGIN, y);
    c.stroke();
}

/// The invoice of `tenant_name` as a PDF document.
pub fn invoice_pdf(inv: &Invoice, tenant_name: &str) -> Vec<u8> {
    let rows = rows_of(inv);
    let pages = paginate(&rows);
    let n = pages.len();
    let month = inv.period_start.format("%Y-%m").to_string();

    let mut pdf = Pdf::new();
    let catalog = Ref::new(1);
    let tree = Ref::new(2);
    let info = Ref::new(3);
    let fonts = [Ref::new(4), Ref::new(5), Ref::new(6), Ref::new(7)];
    let first_page = 8;
    let page_ids: Vec<Ref> = (0..n)
        .map(|i| Ref::new(first_page + 2 * i as i32))
        .collect();
    pdf.catalog(catalog).pages(tree);
    pdf.pages(tree)
        .kids(page_ids.iter().copied())
        .count(n as i32);
    pdf.document_info(info)
        .title(TextStr(&format!(
            "Cachet invoice {month} for {tenant_name}"
        )))
        .creator(TextStr("Cachet"))
        .producer(TextStr("Cachet billing (pdf-writer)"));
    for (id, base) in fonts.iter().zip([
        &b"Helvetica"[..],
        b"Helvetica-Bold",
        b"Courier",
        b"Courier-Bold",
    ]) {
        pdf.type1_font(*id)
            .base_font(Name(base))
            .encoding_predefined(Name(b"WinAnsiEncoding"));
    }
    for (i, page_rows) in pages.iter().enumerate() {
        let page_id = page_ids[i];
        let content_id = Ref::new(page_id.get() + 1);
        let mut page = pdf.page(page_id);
        page.media_box(Rect::new(0.0, 0.0, WIDTH, HEIGHT));
        page.parent(tree);
        page.contents(content_id);
        let mut res = page.resources();
        let mut f = res.fonts();
        for (name, id) in [SANS, SANS_BOLD, MONO, MONO_BOLD].into_iter().zip(fonts) {
            f.pair(name, id);
        }
        f.finish();
        res.finish();
        page.finish();

        let mut c = Content::new();
        let mut y = heading(&mut c, inv, tenant_name, &month, i == 0);
        y = table(&mut c, page_rows, &inv.currency, y);
        if i + 1 == n {
            totals(&mut c, inv, y);
        }
        text(
            &mut c,
            SANS,
            8.0,
            WIDTH - MARGIN - 60.0,
            MARGIN - 20.0,
            &format!("page {} of {n}", i + 1),
        );
        pdf.stream(content_id, &c.finish());
    }
    pdf.finish()
}

/// The invoice's lines as table rows: descriptions wrapped, amounts exact as rated, then the
/// rounding row ([`crate::rounding`]: the amount column adds up to the total).
fn rows_of(inv: &Invoice) -> Vec<Row> {
    let cur = &inv.currency;
    let mut rows: Vec<Row> = inv
        .lines
        .iter()
        .enumerate()
        .map(|(i, l)| Row {
            number: (i + 1).to_string(),
            description: wrap(&l.description, COLS[1] - 2),
            quantity: l.quantity.to_string(),
            amount: format_exact(l.exact(cur), cur),
        })
        .collect();
    let r = inv.rounding();
    rows.push(Row {
        number: String::new(),
        description: wrap(ROUNDING_LINE, COLS[1] - 2),
        quantity: String::new(),
        amount: format_exact(r, cur),
    });
    rows
}

/// Rows into pages: the first page starts below the header, later ones near the top.
fn paginate(rows: &[Row]) -> Vec<Vec<&Row>> {
    let mut pages: Vec<Vec<&Row>> = vec![Vec::new()];
    let mut y = HEIGHT - 210.0;
    for r in rows {
        if y - r.height() < BOTTOM && !pages.last().is_some_and(|p| p.is_empty()) {
            pages.push(Vec::new());
            y = HEIGHT - 110.0;
        }
        y -= r.height();
        if let Some(p) = pages.last_mut() {
            p.push(r);
        }
    }
    pages
}

/// A page's heading (the invoice's facts on the first page, a continuation line on the
/// others); where the table starts.
fn heading(c: &mut Content, inv: &Invoice, tenant_name: &str, month: &str, first: bool) -> f32 {
    let mut y = HEIGHT - MARGIN - 10.0;
    if first {
        text(c, SANS_BOLD, 18.0, MARGIN, y, "Invoice");
        text(
            c,
            SANS,
            10.0,
            WIDTH - MARGIN - 150.0,
            y + 4.0,
            "Cachet prompt caching",
        );
        y -= 28.0;
        let when = |t: chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%d %H:%M UTC").to_string();
        let facts = [
            ("Billed to", tenant_name.to_string()),
            ("Period", format!("{month} (UTC calendar month)")),
            ("Status", inv.status.clone()),
            ("Invoice", inv.id.to_string()),
            ("Rated at", when(inv.rated_at)),
            (
                "Finalized at",
                inv.finalized_at
                    .map_or_else(|| "not yet (draft)".to_string(), when),
            ),
        ];
        for (k, v) in facts {
            text(c, SANS_BOLD, 10.0, MARGIN, y, k);
            text(c, SANS, 10.0, MARGIN + 80.0, y, &v);
            y -= 14.0;
        }
        y -= 12.0;
    } else {
        text(
            c,
            SANS_BOLD,
            11.0,
            MARGIN,
            y,
            &format!("Invoice {month} for {tenant_name} (continued)"),
        );
        y -= 30.0;
    }
    y
}

/// The line table's head and `rows` from `y` down; where it ends.
fn table(c: &mut Content, rows: &[&Row], currency: &str, mut y: f32) -> f32 {
    let amount_head = format!("Amount ({currency})");
    text(
        c,
        MONO_BOLD,
        SIZE,
        MARGIN,
        y,
        &row_text(["#", "Description", "Quantity", &amount_head]),
    );
    rule(c, y - 4.0);
    y -= LEADING + 4.0;
    for r in rows {
        for (j, d) in r.description.iter().enumerate() {
            let cells = if j == 0 {
                [
                    r.number.as_str(),
                    d.as_str(),
                    r.quantity.as_str(),
                    r.amount.as_str(),
                ]
            } else {
                ["", d.as_str(), "", ""]
            };
            text(c, MONO, SIZE, MARGIN, y, &row_text(cells));
            y -= LEADING;
        }
    }
    y
}

/// The last page's total and notes, below the table.
fn totals(c: &mut Content, inv: &Invoice, mut y: f32) {
    rule(c, y + LEADING - 4.0);
    y -= 6.0;
    let total = format!(
        "Total {} {}",
        format_minor(inv.total_minor, &inv.currency),
        inv.currency
    );
    text(
        c,
        SANS_BOLD,
        12.0,
        WIDTH - MARGIN - 0.6 * 12.0 * total.len() as f32,
        y,
        &total,
    );
    y -= 18.0;
    let mut notes = vec![
        "Line amounts are exact as rated; the total is their exact sum, rounded once, and the \
         rounding row says by how much, so the amounts add up to the total."
            .to_string(),
    ];
    if !inv.unpriced.is_empty() {
        notes.push(format!(
            "Usage of {} had no price in force and is listed at zero.",
            inv.unpriced.join(", ")
        ));
    }
    for note in notes {
        for l in wrap(&note, 100) {
            text(c, SANS, 8.0, MARGIN, y, &l);
            y -= 11.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::invoice::{Line, LineKind};

    fn invoice(lines: usize) -> Invoice {
        Invoice {
            id: uuid::Uuid::nil(),
            tenant_id: uuid::Uuid::nil(),
            period_start: chrono::NaiveDate::from_ymd_opt(2026, 10, 1).unwrap(),
            currency: "USD".into(),
            status: "draft".into(),
            total_minor: 1234,
            lines: (0..lines)
                .map(|i| Line {
                    kind: LineKind::Usage,
                    model: Some("sim-tiny".into()),
                    token_class: Some("input".into()),
                    price_from: None,
                    quantity: 1000 + i as i64,
                    exact_nanos: "3000.000000001".into(),
                    amount_minor: 0,
                    description: "sim-tiny input: 1000 tokens at 3000 nano/token × 1.0000, a description long enough to wrap".into(),
                })
                .collect(),
            unpriced: vec![],
            rated_at: "2026-11-01T00:00:00Z".parse().unwrap(),
            finalized_at: None,
        }
    }

    #[test]
    fn descriptions_wrap_at_spaces_and_long_words_are_cut() {
        assert_eq!(wrap("a bb ccc", 4), ["a bb", "ccc"]);
        assert_eq!(wrap("abcdefghij", 4), ["abcd", "efgh", "ij"]);
        assert_eq!(wrap("", 4), [""]);
    }

    fn page_count(pdf: &[u8]) -> usize {
        let t = String::from_utf8_lossy(pdf);
        let i = t.find("/Count ").expect("a page tree") + "/Count ".len();
        t[i..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap()
    }

    #[test]
    fn a_long_invoice_continues_on_numbered_pages() {
        let one = invoice_pdf(&invoice(3), "acme, inc.");
        assert!(one.starts_with(b"%PDF-"));
        assert_eq!(page_count(&one), 1);
        let many = invoice_pdf(&invoice(120), "acme");
        let n = page_count(&many);
        assert!(n > 1, "{n} pages");
        assert!(String::from_utf8_lossy(&many).contains(&format!("(page {n} of {n})")));
    }

    #[test]
    fn text_is_win_ansi() {
        assert_eq!(win_ansi("a€×é✓"), vec![b'a', 0x80, 0xd7, 0xe9, b'?']);
    }
}
