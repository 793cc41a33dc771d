import { useState } from "preact/hooks";
import { login } from "../api";
import { ErrorBanner, Field, message } from "../components/ui";

export function LoginPage() {
  const [username, setUsername] = useState("");
  const [password, setPassword] = useState("");
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  return (
    <article>
      <h1>Cachet admin</h1>
      <form
        onSubmit={async (e) => {
          e.preventDefault();
          if (!username.trim() || !password) {
            setError("Enter your username and password.");
            return;
          }
          setBusy(true);
          try {
            await login(username.trim(), password);
            setError(null);
          } catch (err) {
            setError(message(err));
          } finally {
            setBusy(false);
          }
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
        <Field
          id="password"
          label="Password"
          type="password"
          autoComplete="current-password"
          value={password}
          onInput={(e) => setPassword(e.currentTarget.value)}
          required
        />
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
    </article>
  );
}
