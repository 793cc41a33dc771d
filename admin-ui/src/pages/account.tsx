import { useState } from "preact/hooks";
import { api, type Me } from "../api";
import { ErrorBanner, message, NewPasswordFields, Notice, PasswordField, useAction } from "../components/ui";
import { validateNewPassword } from "../forms";

/** The caller's own account: its password. */
export function AccountPage({ me }: { me: Me }) {
  const [f, setF] = useState({ current: "", password: "", confirm: "" });
  const [errors, setErrors] = useState<Record<string, string>>({});
  const [notice, setNotice] = useState<string | null>(null);
  const { busy, error, run } = useAction();
  return (
    <section>
      <h1>Your account</h1>
      <p>
        {me.username} · {me.role.replace("_", " ")}
        {me.tenant_name ? ` · ${me.tenant_name}` : ""}
      </p>
      <h2>Change your password</h2>
      <Notice text={notice} />
      <form
        aria-label="Change your password"
        onSubmit={async (e) => {
          e.preventDefault();
          const errs = validateNewPassword({ username: me.username, password: f.password, confirm: f.confirm });
          if (!f.current) errs.current = "enter your current password";
          setErrors(errs);
          if (Object.keys(errs).length) return;
          await run(async () => {
            await api("POST", "/v1/admin/me/password", { current_password: f.current, new_password: f.password });
            setF({ current: "", password: "", confirm: "" });
            setNotice("Password changed. Your other sessions have been logged out.");
          }, (err) => {
            setNotice(null);
            return message(err);
          });
        }}
      >
        <PasswordField id="current-password" label="Current password" kind="current" value={f.current}
          error={errors.current} onValue={(current) => setF({ ...f, current })} />
        <NewPasswordFields id="new" form={f} errors={errors} onChange={setF} />
        <ErrorBanner error={error} />
        <button type="submit" aria-busy={busy} disabled={busy}>
          Change password
        </button>
      </form>
    </section>
  );
}
