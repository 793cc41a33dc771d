import { useState } from "preact/hooks";
import { api, login } from "../api";
import { ErrorBanner, Field, NewPasswordFields, Notice, PasswordField, useAction } from "../components/ui";
import { validateNewPassword } from "../forms";

/** Set a new password with the one-time reset secret a platform admin gave you. */
function RedeemReset(props: { onDone: (note: string) => void; onCancel: () => void }) {
  const [f, setF] = useState({ secret: "", password: "", confirm: "" });
  const [errors, setErrors] = useState<Record<string, string>>({});
  const { busy, error, run } = useAction();
  return (
    <form
      aria-label="Set a new password"
      onSubmit={async (e) => {
        e.preventDefault();
        const errs = validateNewPassword({ username: "", password: f.password, confirm: f.confirm });
        if (!f.secret.trim()) errs.secret = "paste the reset secret you were given";
        setErrors(errs);
        if (Object.keys(errs).length) return;
        await run(async () => {
          await api("POST", "/v1/admin/password-reset", { reset_secret: f.secret.trim(), new_password: f.password });
          props.onDone("Password set. Log in with it.");
        });
      }}
    >
      <Field id="reset-secret" label="Reset secret" autoComplete="off" value={f.secret} error={errors.secret} onInput={(e) => setF({ ...f, secret: e.currentTarget.value })} />
      <NewPasswordFields id="reset" form={f} errors={errors} onChange={setF} />
      <ErrorBanner error={error} />
      <div class="actions">
        <button type="button" class="secondary" onClick={props.onCancel}>
          Back to log in
        </button>
        <button type="submit" aria-busy={busy} disabled={busy}>
          Set password
        </button>
      </div>
    </form>
  );
}

export function LoginPage() {
  const [resetting, setResetting] = useState(false);
  const [notice, setNotice] = useState<string | null>(null);
  if (resetting) {
    return (
      <article>
        <h1>Cachet admin</h1>
        <RedeemReset
          onCancel={() => setResetting(false)}
          onDone={(note) => {
            setNotice(note);
            setResetting(false);
          }}
        />
      </article>
    );
  }
  return <LoginForm notice={notice} onReset={() => setResetting(true)} />;
}

function LoginForm(props: { notice: string | null; onReset: () => void }) {
  const [username, setUsername] = useState("");
  const [password, setPassword] = useState("");
  const { busy, error, setError, run } = useAction();
  return (
    <article>
      <h1>Cachet admin</h1>
      <Notice text={props.notice} />
      <form
        onSubmit={async (e) => {
          e.preventDefault();
          if (!username.trim() || !password) {
            setError("Enter your username and password.");
            return;
          }
          await run(async () => {
            await login(username.trim(), password);
          });
        }}
      >
        <Field
          id="username"
          label="Username"
          autoComplete="username"
          value={username}
          onInput={(e) => setUsername(e.currentTarget.value)}
          required
        />
        <PasswordField id="password" label="Password" kind="current" value={password} onValue={setPassword} required />
        <ErrorBanner error={error} />
        <button type="submit" aria-busy={busy} disabled={busy}>
          Log in
        </button>
      </form>
      <p>
        <small>
          Users are made with <code>cachet admin user create</code>; there is no default password.
        </small>
      </p>
      <p>
        <button type="button" class="secondary outline" onClick={props.onReset}>
          I have a reset secret
        </button>
      </p>
    </article>
  );
}
