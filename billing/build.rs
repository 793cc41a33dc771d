// The migrations are embedded by `sqlx::migrate!`: a new or changed migration must rebuild
// this crate (sqlx's documented companion to the macro).
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
